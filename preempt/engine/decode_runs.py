"""Decode runs: steps in which the running batch only decodes, decided and applied in one
go (`Engine.run`'s fast path).

Owns: when the next steps are plain decodes (`decode_run`), how many the free blocks
allow and in which order they allocate (`fit_decode_run`), and their effect on the
requests (`apply_decode_run`), each exactly what that many `schedule` +
`update_from_output` calls would do: the replay's every request field, record, counter
and clock reading stay the same bit for bit (tests/engine/test_decode_runs.py compares
stepping and runs on workloads under memory pressure). A mixin of `Scheduler`, reading
its state; plain Python. Why: most steps of a replay are such steps (457,285 of the
azure-conv hour's 478,981 on the null backend), and one Python pass per request per step
was nearly all of its time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from preempt.core.block_pool import blocks_needed
from preempt.core.request import Request
from preempt.engine.policies import SchedulingPolicy


class DecodeRun(NamedTuple):
    """Steps in which the running batch only decodes (`Scheduler.decode_run`)."""

    requests: list[Request]  # the batch, running order
    max_steps: int  # its first finish is in this step


class DecodeRuns:
    """`Scheduler`'s decode runs (module doc)."""

    def decode_run(self, now: float) -> DecodeRun | None:
        """The next steps as one decode run (`Engine.run`'s fast path), or None when the
        next step may decide anything.

        A plain decode step: every running request computes its one next token (within
        the token budget; no sampling params whose stop tokens need checking), the policy
        keeps no per-step state (`on_step` is the base no-op), and nothing else happens:
        nobody is admitted and nobody preempted for priority. That holds with an empty
        queue, and with a waiting head that stays out: the policy never preempts for
        priority (`priority_victim` is the base one, so the gate's rate cap has nothing to
        refuse), the backoff does not hold it, nobody is paused or prefetched (so blocks
        come back to nobody), and it finds no seat, or no token budget, or fewer free
        blocks than it needs once the first step's decodes took theirs (blocks only get
        fewer during a run). Such steps repeat as long as nothing arrives, nobody finishes
        and blocks do not run out: `max_steps` is the first finish (the step that makes it
        included); `fit_decode_run` cuts it at the blocks, the engine at the next arrival."""
        running = self.running
        if (
            not running
            or self.restores
            or self.paused
            or len(running) > self.config.max_num_batched_tokens
            or type(self.policy).on_step is not SchedulingPolicy.on_step
        ):
            return None
        block_size = self.block_size
        first_step_blocks = 0  # blocks the first step's decodes take
        for request in running:
            if (
                request.num_computed_tokens + 1 != request.num_tokens
                or request.sampling is not None
                or not request.output_token_ids
            ):
                return None
            room = len(request.block_ids) * block_size - request.num_computed_tokens
            if room <= 0:
                if room < 0:
                    return None  # not a state a step leaves (blocks cover what is computed)
                first_step_blocks += 1
        if self.waiting:
            if type(self.policy).priority_victim is not SchedulingPolicy.priority_victim:
                return None
            if self.gate.backoff.holds(now):
                return None  # it might end during the run
            budget = self.config.max_num_batched_tokens - len(running)
            if budget > 0 and len(running) < self.config.max_num_seqs:
                need = self._admission_blocks(self.waiting.peek(), budget)
                if need <= self.block_pool.num_free - first_step_blocks:
                    return None  # the first step admits it
        max_steps = min(min(r.max_tokens, r.target_output_tokens) - len(r.output_token_ids) for r in running)
        return DecodeRun(list(running), max_steps)

    def queues_behind_head(self, request: Request) -> bool:
        """Whether `request`, arriving during a decode run, changes nothing before the run
        ends: the run found the waiting head out (`decode_run`: no seat, no token budget or
        too few blocks, none of which comes back before a finish or a preemption ends the
        run), admission never skips the head, and `request` queues behind it (its
        admission key not before the head's; equal keys first in, first out), with no
        enqueue hook of the policy's to run."""
        return (
            bool(self.waiting)
            and type(self.policy).on_enqueue is SchedulingPolicy.on_enqueue
            and not self.waiting.would_lead(request)
        )

    def _admission_blocks(self, request: Request, budget: int) -> int:
        """Free blocks `_admit_waiting` needs to admit `request` with `budget` tokens
        left: for its whole sequence (`reserve_full_sequence`) and for its first chunk."""
        need = self._admission_missing_blocks(request) if self.config.reserve_full_sequence else 0
        num_tokens = request.num_computed_tokens + min(
            request.num_tokens - request.num_computed_tokens, budget
        )
        if num_tokens > len(request.block_ids) * self.block_size:
            need = max(need, blocks_needed(num_tokens, self.block_size) - len(request.block_ids))
        return need

    def fit_decode_run(self, run: DecodeRun, num_steps: int) -> tuple[int, list[int]]:
        """How many of `num_steps` decode steps of `run` the free blocks allow, and the
        order of their block allocations (indices into `run.requests`): the order the
        steps would allocate in, step by step and running order within a step. A step
        whose allocation would find the pool empty needs a memory preemption: the run
        ends before it."""
        block_size = self.block_size
        events: list[tuple[int, int]] = []  # (step, index): that step's token needs a new block
        for index, request in enumerate(run.requests):
            room = len(request.block_ids) * block_size - request.num_computed_tokens
            events.extend((step, index) for step in range(room + 1, num_steps + 1, block_size))
        events.sort()
        num_free = self.block_pool.num_free
        if len(events) > num_free:
            num_steps = events[num_free][0] - 1
            events = [event for event in events[:num_free] if event[0] <= num_steps]
        return num_steps, [index for _, index in events]

    def apply_decode_run(
        self,
        requests: list[Request],
        start_s: float,
        step_s: Sequence[float],
        ends_s: Sequence[float],
        tokens: Sequence[Sequence[int]],
        allocations: Sequence[int],
    ) -> list[Request]:
        """Apply `len(step_s)` decode steps of `requests` at once, as that many `schedule`
        and `update_from_output` calls would have (`start_s`: the clock before the first,
        `step_s`: each step's seconds, `ends_s`: the clock after each, `tokens[i]`: request
        i's new tokens, `allocations`: `fit_decode_run`'s order). Each request's times are
        summed step by step, as the single steps would (floating-point sums depend on
        their order). Returns the requests that finished in the last step, running order."""
        self.settle_saves()
        self.copy_out.new_step()
        self._batch_reuses_copy_out = False
        self._now = ends_s[-2] if len(ends_s) > 1 else start_s  # when the last step was scheduled
        for index, block_id in zip(allocations, self.block_pool.allocate(len(allocations)), strict=True):
            requests[index].block_ids.append(block_id)
        num_steps = len(step_s)
        now = ends_s[-1]
        finished: list[Request] = []
        for request, new_tokens in zip(requests, tokens, strict=True):
            slice_used_s, executed_s = request.slice_used_s, request.executed_s
            for seconds in step_s:
                slice_used_s += seconds
                executed_s += seconds
            request.slice_used_s, request.executed_s = slice_used_s, executed_s
            request.num_computed_tokens += num_steps
            request.output_token_ids.extend(new_tokens[:-1])
            if self.remaining is not None and num_steps > 1:
                # the estimate as the last step but one left it (a request that finishes
                # keeps that one, as after a single step)
                self.remaining.update(request)
            request.output_token_ids.append(new_tokens[-1])
            if request.is_finished_generating:
                request.finish_s = now
                finished.append(request)
            elif self.remaining is not None:
                self.remaining.update(request)
        self._remove_finished(finished)
        return finished
