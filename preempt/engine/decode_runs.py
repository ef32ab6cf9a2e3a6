"""Decode runs: steps in which the running batch only decodes, decided and applied in one
go (`Engine.run`'s fast path).

Owns: when the next steps are plain decodes (`decode_run`), how many the free blocks
allow and in which order they allocate (`decode_run_allocations`), and their effect on the
requests (`apply_decode_run`), each exactly what that many `schedule` +
`update_from_output` calls would do: the replay's every request field, record, counter
and clock reading stay the same bit for bit (tests/engine/test_decode_runs.py compares
stepping and runs on workloads under memory pressure). A mixin of `Scheduler`, reading
its state; plain Python. Why: most steps of a replay are such steps (457,285 of the
azure-conv hour's 478,981 on the null backend), and one Python pass per request per step
was nearly all of its time.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from preempt.core.block_pool import blocks_needed
from preempt.core.request import Request, RequestState
from preempt.engine.policies import SchedulingPolicy


class DecodeRun(NamedTuple):
    """Steps in which the running batch only decodes (`Scheduler.decode_run`)."""

    requests: list[Request]  # the batch, running order
    max_steps: int  # its first finish is in this step
    # The waiting head, which stays out, when a step of the run may still displace someone
    # for it (the policy preempts for priority): `apply_decode_run` asks before each step.
    challenger: Request | None
    # The backoff holds the head out till then: the run takes no step scheduled later.
    until_s: float


class RunSteps(NamedTuple):
    """The steps a decode run may take (`Engine._decode_run` plans them)."""

    start_s: float  # the clock before the first
    step_s: list[float]  # each step's seconds
    ends_s: list[float]  # the clock after each
    tokens: list[list[int]]  # tokens[i]: request i's new tokens, one per step
    allocations: list[tuple[int, int]]  # `decode_run_allocations`: (step, request index)
    # Arrivals that queue behind the head (`queues_behind_head`), with the step they land
    # in: each joins the queue before the next step's schedule, as the engine's loop would.
    joins: list[tuple[int, Request]]


class DecodeRuns:
    """`Scheduler`'s decode runs (module doc)."""

    def decode_run(self, now: float) -> DecodeRun | None:
        """The next steps as one decode run (`Engine.run`'s fast path), or None when the
        next step may decide anything.

        A plain decode step: every running request computes its one next token (within
        the token budget; no sampling params whose stop tokens need checking), and nobody
        is admitted. That holds with an empty queue, and with a waiting head that stays
        out: nobody is paused or prefetched (so blocks come back to nobody), and the
        backoff holds it (until `until_s`, where the run ends), or it finds no seat, or no
        token budget, or fewer free blocks than it needs once the first step's decodes
        took theirs (blocks only get fewer during a run). Such steps repeat as long as
        nothing arrives, nobody finishes and blocks do not run out: `max_steps` is the
        first finish (the step that makes it included) or the last step before one whose
        allocation would find the pool empty (that one needs a memory preemption); the
        engine ends the run at the next arrival, and `apply_decode_run` at the policy:
        before a step in which it would displace someone for the head, and where its
        per-step state says (`quiet_steps`)."""
        running = self.running
        if not running or self.restores or self.paused or len(running) > self.config.max_num_batched_tokens:
            return None
        if not self.policy.takes_decode_runs:
            return None
        head = self.waiting.peek() if self.waiting else None
        held = head is not None and self._held_by_backoff(head, now)
        need = None  # blocks the head needs, where a seat and token budget would admit it
        budget = self.config.max_num_batched_tokens - len(running)
        if head is not None and not held and budget > 0 and len(running) < self.config.max_num_seqs:
            need = self._admission_blocks(head, budget)
            if need <= self.block_pool.num_free - len(running):
                return None  # the first step admits it, whatever its decodes take
        block_size = self.block_size
        rooms = []  # tokens each request's blocks still hold
        for request in running:
            output = request.output_token_ids
            computed = request.num_computed_tokens
            if (
                computed + 1 != request.num_prompt_tokens + len(output)
                or request.sampling is not None
                or not output
            ):
                return None
            room = len(request.block_ids) * block_size - computed
            if room < 0:
                return None  # not a state a step leaves (blocks cover what is computed)
            rooms.append(room)
        if need is not None and need <= self.block_pool.num_free - rooms.count(0):
            return None  # the first step admits it once its decodes took their blocks
        challenger = head if head is not None and self.policy.preempts_for_priority else None
        until_s = self.gate.backoff.until_s if held else math.inf
        max_steps = min(min(r.max_tokens, r.target_output_tokens) - len(r.output_token_ids) for r in running)
        max_steps = self._steps_the_pool_allows(rooms, max_steps)
        if max_steps == 0:
            return None  # the first step needs a memory preemption
        return DecodeRun(list(running), max_steps, challenger, until_s)

    def _steps_the_pool_allows(self, rooms: list[int], max_steps: int) -> int:
        """The most of `max_steps` decode steps the free blocks allow, given the tokens
        each request's blocks still hold (`rooms`): the step count at which the blocks
        taken so far first exceed the free ones, less one (a binary search over a count
        that only grows; each request takes a block every `block_size` steps)."""
        block_size, num_free = self.block_size, self.block_pool.num_free

        def taken(num_steps: int) -> int:
            return sum((num_steps - room - 1) // block_size + 1 for room in rooms if num_steps > room)

        if taken(max_steps) <= num_free:
            return max_steps
        fits, runs_out = 0, max_steps
        while runs_out - fits > 1:
            middle = (fits + runs_out) // 2
            if taken(middle) <= num_free:
                fits = middle
            else:
                runs_out = middle
        return fits

    def queues_behind_head(self, request: Request) -> bool:
        """Whether `request`, arriving during a decode run, changes nothing in it: the run
        found the waiting head out (`decode_run`: held by the backoff, or no seat, no
        token budget or too few blocks, none of which comes back before a finish or a
        preemption ends the run), admission never skips the head, and `request` queues
        behind it (`arrival_key` not before the head's key; equal keys first in, first
        out). The run then queues it where it landed (`RunSteps.joins`)."""
        if not self.waiting:
            return False
        if self.remaining is not None:
            # its key reads the estimate `add_request` sets (the same then: nothing it
            # reads changes before the request joins)
            self.remaining.update(request)
        return not self.waiting.would_lead(self.policy.arrival_key(request))

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

    def decode_run_allocations(self, run: DecodeRun, num_steps: int) -> list[tuple[int, int]]:
        """The block allocations of the first `num_steps` steps of `run` (at most
        `max_steps`, which the free blocks allow), as (step, index into `run.requests`), in
        the order the steps would allocate: step by step, running order within a step."""
        block_size = self.block_size
        events: list[tuple[int, int]] = []  # (step, index): that step's token needs a new block
        for index, request in enumerate(run.requests):
            room = len(request.block_ids) * block_size - request.num_computed_tokens
            events.extend((step, index) for step in range(room + 1, num_steps + 1, block_size))
        events.sort()
        return events

    def apply_decode_run(self, run: DecodeRun, steps: RunSteps) -> tuple[int, int, list[Request]]:
        """Apply up to `len(steps.step_s)` decode steps of `run` at once, as that many
        `schedule` and `update_from_output` calls would have, queueing the arrivals that
        land in them (`steps.joins`) where those calls would. The run ends sooner where the
        policy decides: after a step whose per-step state moves a new request to the head
        of the queue, and before one whose priority check would displace someone (that
        step is decided on its own). Returns how many steps ran, how many arrivals joined
        (the first of `joins`), and the requests that finished in the last step (running
        order)."""
        self.settle_saves()
        self.copy_out.new_step()
        self._batch_reuses_copy_out = False
        num_steps, done, joined = self._between_steps(run, steps)
        if done == num_steps:  # none to run, or all applied already
            return num_steps, joined, []
        finished = self._apply_steps(run.requests, steps, done, num_steps)
        self._remove_finished(finished)
        return num_steps, joined, finished

    def _between_steps(self, run: DecodeRun, steps: RunSteps) -> tuple[int, int, int]:
        """What each step's `schedule` meets before it decodes, in the order it would:

        - the policy's per-step state: where a step may move waiting requests (`quiet_steps`
          says which), the steps up to it are applied (their `on_decode_run` re-keys
          those); the run ends there if the head of the queue changed;
        - the arrivals that landed in the step before join the queue (behind its head);
          with an enqueue hook of the policy's that reads its per-step state
          (`enqueue_reads_steps`), once the steps before are applied, so the hook sees
          the state and clock it would;
        - the priority check (`_priority_preemption`), dry: the head admissible
          (`_can_admit` at that step's free blocks), the gate not asking the policy
          (`asks_policy`, which counts a refusal of the rate cap as the step would), or the
          policy naming nobody lets the step run. Where the policy must be asked, the
          steps before are applied first, so it reads the state that step would; the run
          ends before a step in which it names a victim.

        Returns how many steps the run takes, how many of them it applied, and how many
        arrivals joined."""
        requests, ends_s = run.requests, steps.ends_s
        num_steps = len(ends_s)
        quiet = self.policy.quiet_steps(requests, ends_s)  # the policy may move someone after this step
        joins, challenger = steps.joins, run.challenger
        if quiet >= num_steps and challenger is None and not joins:
            return num_steps, 0, 0
        head = self.waiting.peek() if self.waiting else None
        hooked = (
            type(self.policy).on_enqueue is not SchedulingPolicy.on_enqueue
            and self.policy.enqueue_reads_steps
        )
        if challenger is not None:
            fresh = challenger.state is RequestState.WAITING
            num_missing = self._admission_missing_blocks(challenger)
            seated = self.num_seated < self.config.max_num_seqs
        num_free = self.block_pool.num_free
        allocations = steps.allocations
        allocated = 0  # allocations of the steps before this one
        done = joined = 0  # steps applied, arrivals queued
        for step in range(1, num_steps + 1):
            before = step - 1
            if before == quiet:
                if done < before:
                    self._apply_steps(requests, steps, done, before)
                    done = before
                if (self.waiting.peek() if self.waiting else None) is not head:
                    return before, done, joined
                more = self.policy.quiet_steps(requests, ends_s[before:])
                if more == 0:
                    return before, done, joined
                quiet = before + more
            while joined < len(joins) and joins[joined][0] < step:
                if hooked and done < before:
                    self._apply_steps(requests, steps, done, before)
                    done = before
                self.add_request(joins[joined][1])
                joined += 1
            if challenger is None:
                continue
            while allocated < len(allocations) and allocations[allocated][0] < step:
                allocated += 1
            now = steps.start_s if step == 1 else ends_s[step - 2]
            if seated and num_missing <= num_free - allocated:
                continue  # `_can_admit`: the check is not made
            if not self.gate.asks_policy(now, fresh):
                continue
            if done < before:
                self._apply_steps(requests, steps, done, before)
                done = before
            if self.policy.priority_victim(challenger, self.gate.eligible(self.running), now) is not None:
                return before, done, joined
        return num_steps, done, joined

    def _apply_steps(self, requests: list[Request], steps: RunSteps, first: int, last: int) -> list[Request]:
        """Steps `first`+1 .. `last` of a run (1-based), `first` of them applied already.
        Each request's times are summed step by step, as the single steps would
        (floating-point sums depend on their order). Returns the requests that finished in
        step `last` (the run's first finish is in its last step, so only there)."""
        ends_s = steps.ends_s
        self._now = ends_s[last - 2] if last > 1 else steps.start_s  # when the last step was scheduled
        step_s = steps.step_s[first:last]
        new_blocks = [index for step, index in steps.allocations if first < step <= last]
        for index, block_id in zip(new_blocks, self.block_pool.allocate(len(new_blocks)), strict=True):
            requests[index].block_ids.append(block_id)
        num_steps = last - first
        now = ends_s[last - 1]
        finished: list[Request] = []
        for request, new_tokens in zip(requests, steps.tokens, strict=True):
            slice_used_s, executed_s = request.slice_used_s, request.executed_s
            for seconds in step_s:
                slice_used_s += seconds
                executed_s += seconds
            request.slice_used_s, request.executed_s = slice_used_s, executed_s
            request.num_computed_tokens += num_steps
            request.output_token_ids.extend(new_tokens[first : last - 1])
            if self.remaining is not None and num_steps > 1:
                # the estimate as the last step but one left it (a request that finishes
                # keeps that one, as after a single step)
                self.remaining.update(request)
            request.output_token_ids.append(new_tokens[last - 1])
            if request.is_finished_generating:
                request.finish_s = now
                finished.append(request)
            elif self.remaining is not None:
                self.remaining.update(request)
        moved = self.policy.on_decode_run(requests, step_s, ends_s[first:last])
        if moved:  # by the last step (`_between_steps` applies no further than `quiet_steps`)
            self.waiting.rekey(moved)
        return finished
