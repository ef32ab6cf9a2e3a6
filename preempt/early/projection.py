"""The cheap forecast: which running requests the scheduler preempts within the horizon,
projected from the present state without forking the engine.

The `forecast` early-save policy forks the whole engine (`preempt.early.lookahead`) and
steps the copy; this projection reads the present instead and steps only numbers: per
running request its tokens, computed tokens and blocks, and the free blocks, the waiting
queue's heads and the seats. Each projected step replays the scheduler's two preemption
rules (`Scheduler.schedule`): a waiting head that cannot be admitted may displace a
running request whose time slice is used (the policy's `priority_victim`, within the rate
cap), and a running request that needs a block when none is free preempts the policy's
memory victim (`select_victim`, PREEMPTION_FAILED requests last), refunding a victim
scheduled earlier in the step and ending the pass when a request preempts itself. Every
request runs to its `max_tokens` (what a server knows), nothing arrives, and each step
lasts what the engine's cost model gives its projected batch (on the wall clock: as long
as the last step ran). Copy stalls are not added.

Where it is not the scheduler, by design (each is cheap to be wrong about within a
horizon of a few steps, and measured: `scripts/projection_agreement.py`): scores are read
once, at the present (age and progress move them by little in 50 ms); a preempted request
does not come back within the horizon; paused requests' blocks, async restores and prefetched
blocks are not modelled; a prefill is scheduled whole or to the
token budget, as the scheduler does. The failure backoff holds never-run requests as the
scheduler holds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preempt.core.block_pool import blocks_needed
from preempt.core.request import RequestState
from preempt.early.lookahead import Forecast, Horizon
from preempt.engine.priority import time_slice_s

if TYPE_CHECKING:
    from preempt.core.config import PreemptionConfig
    from preempt.core.request import Request
    from preempt.engine.view import EngineView


@dataclass(slots=True)
class _Slot:
    """One request's numbers in the projection (the request itself is only read)."""

    request: Request
    num_tokens: int
    num_computed: int
    num_blocks: int
    num_output: int
    slice_used_s: float
    failed: bool  # PREEMPTION_FAILED: a victim of last resort only
    slice_s: float  # its time slice, read once (it moves with the length class only)

    @classmethod
    def of(cls, request: Request, preemption: PreemptionConfig) -> _Slot:
        return cls(
            request,
            request.num_tokens,
            request.num_computed_tokens,
            len(request.block_ids),
            request.num_output_tokens,
            request.slice_used_s,
            request.preemption_failed,
            time_slice_s(request, preemption),
        )


def _waiting(view: EngineView, policy, arrived: list[Request], num: int) -> list[_Slot]:
    """The first `num` requests to admit: the queue's heads merged, in the policy's
    admission order, with `arrived` (those that arrived during the last step, sorted by
    admission key: the next schedule queues them; the fork adds them too). The queue
    keeps ties in arrival order."""
    heads = view.next_to_admit(num)
    merged: list = []
    i = j = 0
    while len(merged) < num and (i < len(heads) or j < len(arrived)):
        if j == len(arrived) or (
            i < len(heads) and policy.admission_key(heads[i]) <= policy.admission_key(arrived[j])
        ):
            merged.append(heads[i])
            i += 1
        else:
            merged.append(arrived[j])
            j += 1
    return [_Slot.of(r, view.config.preemption) for r in merged]


class Projection(Horizon):
    """Forecasts preemptions by stepping the scheduler's block arithmetic ahead."""

    def __init__(
        self, horizon_ms: float, horizon_steps: int = 0, end_of: Callable[[Request], int] | None = None
    ) -> None:
        super().__init__(horizon_ms, horizon_steps)
        # The output length at which a request leaves the projection: its max_tokens (what a
        # server knows); a measurement may pass the true length (`Request.output_limit`) to
        # price what knowing it would be worth (scripts/projection_ceiling.py).
        self.end_of = end_of
        self.num_calls = 0
        self.wall_s = 0.0  # host time spent projecting (the policy's cost)

    def forecast(self, view: EngineView, step_s: float) -> Forecast:
        """Project until both horizons have passed: a preemption decided at the k-th
        step's schedule is k steps and the first k - 1 steps' time ahead, as the fork
        counts. `step_s`: the last step's length (the wall clock's estimate)."""
        started = time.perf_counter()
        self.num_calls += 1
        step_s = max(step_s, 1e-6)
        config = view.config
        policy = view.policy
        block_size = view.block_size
        free = view.num_free_blocks
        running = [_Slot.of(r, config.preemption) for r in view.running]
        # The queue's heads, fetched a few at a time: with seats full only the head is
        # read, and building all `max_num_seqs` of them was a third of the cost.
        arrived = sorted(view.upcoming_arrivals(view.now), key=policy.admission_key)
        num_queued = view.num_waiting + len(arrived)
        num_fetched = min(num_queued, 8 + max(0, view.max_num_seqs - len(running)))
        waiting = _waiting(view, policy, arrived, num_fetched)
        truncated = num_fetched < num_queued
        admitted: set[int] = set()
        seats = view.max_num_seqs - len(view.restoring)
        cap = config.preemption.max_preemption_per_min
        fallback = view.uses_failure_fallback
        backoff_until_s = view.backoff_until_s
        slices = policy.uses_time_slices
        asked: list = [None, None]  # the last (head, candidates) the policy was asked, its answer
        num_in_window = view.preemptions_in_window(view.now)
        preempted: dict[int, tuple[float, int]] = {}
        now = view.now
        end_of = self.end_of

        def preempt(slot: _Slot, elapsed: float, steps: int) -> None:
            nonlocal free
            running.remove(slot)
            free += slot.num_blocks
            preempted.setdefault(slot.request.request_id, (elapsed, steps))

        steps = 0
        elapsed = 0.0  # from now to this step's schedule
        while running or waiting or truncated:
            steps += 1
            if elapsed > self.horizon_s + 1e-9 and steps > self.horizon_steps:
                break
            at = now + elapsed

            # priority: a head that cannot be admitted may displace one request
            held = bool(waiting) and at < backoff_until_s and waiting[0].request.state is RequestState.WAITING
            if waiting and not held and (cap is None or num_in_window < cap):
                head = waiting[0]
                missing = blocks_needed(head.num_tokens, block_size) - head.num_blocks
                if len(running) >= seats or missing > free:
                    for _ in range(len(running)):
                        candidates = [
                            s.request
                            for s in running
                            if not s.failed and (not slices or s.slice_used_s >= s.slice_s)
                        ]
                        # scores are read at the present: the same head and candidates
                        # give the same answer, so the policy is asked again only on change
                        key = (head.request.request_id, tuple(map(id, candidates)))
                        if key != asked[0]:
                            answer = None
                            if candidates:
                                answer = policy.priority_victim(head.request, candidates, at)
                            asked[:] = [key, answer]
                        victim = asked[1]
                        if victim is None:
                            break
                        slot = next(s for s in running if s.request is victim)
                        limit = config.preemption.max_consecutive_preemptions
                        if fallback and victim.num_preemptions >= limit:
                            slot.failed = True  # the fallback keeps it running; ask again
                            continue
                        preempt(slot, elapsed, steps)
                        num_in_window += 1
                        break

            # the running pass: blocks for each request's new tokens, memory victims
            budget = view.max_num_batched_tokens
            scheduled: list[tuple[_Slot, int]] = []
            memory_preempted = False
            index = 0
            while index < len(running) and budget > 0:
                slot = running[index]
                num_new = slot.num_tokens - slot.num_computed
                if num_new == 1 and slot.num_computed < slot.num_blocks * block_size:
                    # most calls: a decode within its last block needs no block
                    scheduled.append((slot, 1))
                    budget -= 1
                    index += 1
                    continue
                num_new = min(num_new, budget)
                need = blocks_needed(slot.num_computed + num_new, block_size) - slot.num_blocks
                stopped = False
                while need > free:
                    others = [s.request for s in running if not s.failed]
                    victim_request = policy.select_victim(others or [s.request for s in running], at)
                    victim = next(s for s in running if s.request is victim_request)
                    for j, (s, n) in enumerate(scheduled):
                        if s is victim:  # refund a victim scheduled earlier this step
                            budget += n
                            del scheduled[j]
                            break
                    victim_index = running.index(victim)
                    preempt(victim, elapsed, steps)
                    memory_preempted = True
                    if victim_index < index:
                        index -= 1
                    if victim is slot:
                        stopped = True
                        break
                if stopped:
                    break  # as vLLM: preempting itself ends the pass
                free -= max(need, 0)
                slot.num_blocks += max(need, 0)
                scheduled.append((slot, num_new))
                budget -= num_new
                index += 1

            # admission, only in a step without memory preemption
            while not memory_preempted and budget > 0 and len(running) < seats:
                while not waiting and truncated:  # fetch more heads (the live queue is unchanged)
                    num_fetched = min(2 * num_fetched, num_queued)
                    fresh = _waiting(view, policy, arrived, num_fetched)
                    waiting = [w for w in fresh if w.request.request_id not in admitted]
                    truncated = num_fetched < num_queued
                if not waiting:
                    break
                head = waiting[0]
                if at < backoff_until_s and head.request.state is RequestState.WAITING:
                    break  # a preemption failure's backoff holds requests that never ran
                num_new = min(head.num_tokens - head.num_computed, budget)
                whole = blocks_needed(head.num_tokens, block_size) - head.num_blocks
                first = blocks_needed(head.num_computed + num_new, block_size) - head.num_blocks
                if (config.scheduler.reserve_full_sequence and whole > free) or first > free:
                    break
                waiting.pop(0)
                admitted.add(head.request.request_id)
                free -= max(first, 0)
                head.num_blocks += max(first, 0)
                head.slice_used_s = 0.0
                running.append(head)
                scheduled.append((head, num_new))
                budget -= num_new

            # the step's length (the cost model on the batch; else the last step's), its
            # results: computed tokens, a token where a sequence's end was reached,
            # requests that reach max_tokens leave
            modelled = view.step_time_s([(slot.num_computed, num_new) for slot, num_new in scheduled])
            this_step_s = modelled if modelled is not None else step_s
            elapsed += this_step_s
            for slot, num_new in scheduled:
                slot.num_computed += num_new
                slot.slice_used_s += this_step_s
                if slot.num_computed >= slot.num_tokens:
                    slot.num_tokens += 1
                    slot.num_output += 1
                    end = slot.request.max_tokens if end_of is None else end_of(slot.request)
                    if slot.num_output >= end:
                        running.remove(slot)
                        free += slot.num_blocks
            if not scheduled:
                break  # nothing can run: the projection cannot move on
        self.wall_s += time.perf_counter() - started
        return Forecast(preempted, steps, elapsed)
