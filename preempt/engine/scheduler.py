"""Continuous batching and preemption: which requests run this step, with how many
tokens, who is preempted, and what happens to a victim's KV.

Owns: the running list, block allocation for scheduled tokens, the preemption decisions
(memory pressure and priority), their rate limit, the failure fallback and the admission
backoff. It admits from a `WaitingQueue` (preempt.engine.waiting: new and preempted
requests in policy order). Plain Python, no torch: moving KV bytes is delegated to a
`KVMover` (the saver), and the scheduler never runs the model or reads a clock of its own
(`schedule(now)` is given the time).

One step is `schedule(now)`, the model run, then `update_from_output(...)` (tokens in,
finished requests out). `schedule(now)`:
0. Priority: if the head of the waiting queue cannot be admitted (no seat or no blocks),
   the policy may name a running request it displaces (at most one per step; only
   requests that used their time slice; never beyond `max_preemption_per_min`).
1. Running requests, in admission order, get their next tokens (1 for decode, a prompt
   chunk otherwise) within the token budget. When blocks run out, paused requests'
   blocks are reclaimed first, then the policy picks a victim among the running
   requests (a forced preemption); if the victim is the requester itself, it waits and
   the pass over running requests ends there.
2. Unless step 1 preempted someone, waiting requests are admitted in policy order while
   the budget, `max_num_seqs` and free blocks allow (with `reserve_full_sequence`, blocks
   for the whole current sequence must be free); the head is never skipped. A
   preempted request resumes by re-pointing its blocks (`pause`), restoring its saved KV
   (`swap*`) or recomputing it.

Asynchronous restores (`preemption.async_restore`): a request admitted with its KV on the
host may wait READY out of the batch, seat and blocks held, until its copy-in ends
(preempt.engine.restores says how and why).

With the vLLM policies and the failure fallback off (their default) steps 1 and 2 are vLLM
0.32's V1 `Scheduler.schedule()` without prefix caching, step for step: `preempt parity
vllm` drives vLLM's own scheduler beside this one and compares every step.

What happens to a victim's KV (`preemption.mode`): `recompute` drops it; `swap` /
`swap_zstd` save it to host memory and free the blocks; `pause` keeps the blocks
resident (zero copy) and saves them (`reclaim_codec`) only when someone needs blocks.
With the failure fallback on (the design's default), a failed save (host pool full,
blob over one slot) or a request already preempted `max_consecutive_preemptions` times
takes the fallback: the request is marked PREEMPTION_FAILED and runs to completion (a
forced preemption still drops its KV, since the blocks are needed), and new admissions
back off exponentially. Without it a failed save only drops the KV for recompute.

The records are the scheduler's: it creates each `PreemptionRecord` and alone writes it,
from the `SaveResult` / `RestoreResult` its `KVMover` returns (a stored size that a
worker learns later arrives through a future, settled at the next `schedule`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from preempt.core.block_pool import BlockPool, blocks_needed
from preempt.core.config import PreemptionConfig, SchedulerConfig
from preempt.core.registry import save_codec
from preempt.core.request import Request, RequestState, ScheduledChunk
from preempt.engine.decode_runs import DecodeRuns
from preempt.engine.gate import PreemptionGate
from preempt.engine.host_copies import HostCopies, recompute_from_scratch
from preempt.engine.policies import SchedulingPolicy
from preempt.engine.priority import time_slice_s
from preempt.engine.remaining import RemainingEstimator
from preempt.engine.restores import AsyncRestores
from preempt.engine.waiting import WaitingQueue
from preempt.kv.copy_out import CopyOut
from preempt.kv.record import KVMover, PreemptionRecord


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]  # what to compute this step, running order
    preempted: list[Request]  # requests preempted this step
    records: list[PreemptionRecord]  # every preemption decision of this step
    num_batched_tokens: int
    # The step reuses blocks whose KV is still being copied out: compute waits till then
    # (0: no wait; see preempt.kv.copy_out).
    copy_out_wait_until_s: float


class Scheduler(DecodeRuns):
    def __init__(
        self,
        config: SchedulerConfig,
        policy: SchedulingPolicy,
        block_pool: BlockPool,
        block_size: int,
        preemption: PreemptionConfig | None = None,
        mover: KVMover | None = None,
        remaining: RemainingEstimator | None = None,
    ) -> None:
        self.config = config
        self.preemption = preemption or PreemptionConfig()
        # Sets each request's expected output left (`preemption.remaining`); None: max_tokens.
        self.remaining = remaining
        if self.preemption.mode != "recompute" and mover is None:
            raise ValueError(f"preemption.mode '{self.preemption.mode}' needs a KV mover (saver)")
        self.policy = policy
        # The rules around the priority trigger (rate cap, backoff, time slices, the failure
        # fallback), shared with the vLLM plugin: preempt.engine.gate.
        self.gate = PreemptionGate(self.preemption, policy)
        self.block_pool = block_pool
        self.block_size = block_size
        self.mover = mover
        self.running: list[Request] = []  # admission order, oldest first
        self.waiting = WaitingQueue(policy.admission_key, self.preemption.priority_weights)
        self.paused: list[Request] = []  # preempted, KV still on the device, oldest first
        self.restores = AsyncRestores()  # READY requests: admitted, copy-in running
        self._batch_reuses_copy_out = False  # this step's batch allocated into copied-out blocks
        self._background_reuses = False  # the async restore being admitted did
        self.records: list[PreemptionRecord] = []
        self.num_preemptions = 0
        self.num_preemption_failed = 0
        self._now = 0.0
        self.copy_out = CopyOut()  # blocks freed by saves whose copy-out may still run
        # victims' KV on the host: the save record each resumes from, and saves whose stored
        # size a worker has yet to report (the copies themselves are the mover's)
        self.host = HostCopies(mover, self.copy_out)

    # ----------------------------------------------------------------- queue
    @property
    def uses_failure_fallback(self) -> bool:
        """The design's fallback (PREEMPTION_FAILED, protected victims, backoff): the
        policy's default unless `preemption.failure_fallback` says (the gate's)."""
        return self.gate.uses_failure_fallback

    @property
    def num_restore_fallbacks(self) -> int:
        return self.host.num_restore_fallbacks

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.restores)

    @property
    def num_seated(self) -> int:
        """Seats taken (`max_num_seqs`): running requests and READY ones."""
        return len(self.running) + len(self.restores)

    @property
    def restoring(self) -> list[Request]:
        """READY requests, admission order (the list itself: read, do not edit)."""
        return self.restores.requests

    def never_fits(self, request: Request) -> str | None:
        """Why `request` could never run in this pool even alone (None: it can): its prompt
        plus `max_tokens` needs more blocks than the pool has."""
        need = blocks_needed(request.num_prompt_tokens + request.max_tokens, self.block_size)
        if need > self.block_pool.num_blocks:
            return f"needs {need} blocks, pool has {self.block_pool.num_blocks}"
        return None

    def add_request(self, request: Request) -> None:
        if request.state is not RequestState.PREEMPTED:
            request.state = RequestState.WAITING
        if self.remaining is not None:
            self.remaining.update(request)
        self.policy.on_enqueue(request)
        self.waiting.push(request)

    def waiting_scores(self, now: float) -> np.ndarray:
        """Priority scores of all waiting requests at `now`, (N,) float64, in no
        particular order: O(N) numpy instead of N score evaluations (the feature logger
        and early-save policies need them every step; `WaitingQueue.scores`)."""
        return self.waiting.scores(now)

    def unfinished_requests(self) -> Iterator[Request]:
        """Every request not yet finished: running, READY, then waiting (heap order, not
        admission order; paused ones wait too). For a fork to copy or rewrite them all."""
        yield from self.running
        yield from self.restores
        yield from self.waiting.unordered()

    def waiting_requests(self) -> list[Request]:
        """Waiting requests in admission order (a copy; for inspection and tests)."""
        return list(self.waiting)

    def next_to_admit(self, k: int) -> list[Request]:
        """The first `k` waiting requests in admission order (read-only: restore prefetch
        asks whom to restore before they are admitted; `WaitingQueue.next_to_admit`)."""
        return self.waiting.next_to_admit(k)

    def preemptions_in_window(self, now: float) -> int:
        return self.gate.rate_window.count(now)

    @property
    def backoff_until_s(self) -> float:
        """New admissions wait until this time (a preemption failure's backoff)."""
        return self.gate.backoff.until_s

    # ----------------------------------------------------------------- step
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        self.settle_saves()
        self._now = now
        self.copy_out.new_step()
        self._batch_reuses_copy_out = False
        if self.restores:
            for request in self.restores.pop_ready(now):
                self._seat(request)
        first_record = len(self.records)
        budget = self.config.max_num_batched_tokens
        chunks: dict[Request, ScheduledChunk] = {}  # insertion ordered (requests hash by identity)
        preempted: list[Request] = []

        victim = self._priority_preemption(now)
        if victim is not None:
            preempted.append(victim)

        memory_preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:  # a prefill chunked to the step's budget
                num_new = budget
            preempted_itself = False
            while not self._allocate_for(request, num_new):
                victim = self.policy.select_victim(self._memory_candidates(), now)
                victim_chunk = chunks.pop(victim, None)
                if victim_chunk is not None:  # refund a victim scheduled earlier this step
                    budget += victim_chunk.num_new_tokens
                victim_index = self.running.index(victim)
                self._preempt(victim, "memory", forced=True)
                preempted.append(victim)
                memory_preempted = True
                if victim_index < index:
                    index -= 1
                if victim is request:
                    preempted_itself = True
                    break
            if preempted_itself:
                # As vLLM: a request that could only make room by preempting itself ends the
                # pass over running requests; those after it wait for the next step.
                break
            chunks[request] = ScheduledChunk(request, num_new)
            budget -= num_new
            index += 1

        if not memory_preempted:
            budget = self._admit_waiting(chunks, budget, now)

        chunk_list = list(chunks.values())
        num_tokens = self.config.max_num_batched_tokens - budget  # what the chunks took
        # Compute waits for copy-outs only where the batch itself reuses their blocks (a
        # READY request that does waits on its own; without async restores that is every
        # allocation, i.e. `copy_out.wait_until_s`).
        wait_until_s = self.copy_out.end_s if self._batch_reuses_copy_out else 0.0
        return SchedulerOutput(chunk_list, preempted, self.records[first_record:], num_tokens, wait_until_s)

    def _seat(self, request: Request) -> None:
        """Into the batch (admission order), its time slice starting now."""
        request.state = RequestState.PREEMPTION_FAILED if request.preemption_failed else RequestState.RUNNING
        request.slice_used_s = 0.0
        self.running.append(request)

    def update_from_output(
        self, output: SchedulerOutput, step_s: float, tokens: Sequence[object], now: float
    ) -> list[Request]:
        """The step ran: the one place its results enter the requests (vLLM V1's
        `update_from_output`, nano-vllm's `postprocess`). `tokens` holds the runner's
        token for each chunk in `output.chunks` (None for a prefill chunk short of the
        prompt's end; an int, or a sample with `token_id` and logprobs); `now` is the
        clock after the step. Charges `step_s` to every request that ran (time slices),
        advances their computed tokens, appends their tokens, applies the sampling stop
        checks, stamps first-token and finish times, and takes the finished requests out
        (FINISHED, blocks freed). Returns them, in running order."""
        finished: list[Request] = []
        for (request, num_new), token in zip(output.chunks, tokens, strict=True):
            request.slice_used_s += step_s
            request.executed_s += step_s
            request.num_computed_tokens += num_new
            if token is None:
                continue
            if not isinstance(token, int):  # a Sample: the token with its logprobs
                request.output_logprobs.append(token)
                token = token.token_id
            request.output_token_ids.append(token)
            if request.sampling is not None and request.sampling.stops_at(token, request.num_output_tokens):
                request.stop_token_id = token
            if request.first_token_s is None:
                request.first_token_s = now
            if request.is_finished_generating:
                request.finish_s = now
                finished.append(request)
            elif self.remaining is not None:
                self.remaining.update(request)
        moved = self.policy.on_step([chunk.request for chunk in output.chunks], step_s, now)
        if moved:  # the policy moved waiting requests (starvation guards)
            # True: "some", as policies written before it named them said (all re-keyed)
            self.waiting.rekey(list(self.waiting.unordered()) if moved is True else moved)
        self._remove_finished(finished)
        return finished

    # ----------------------------------------------------------------- admission
    def _admit_waiting(self, chunks: dict[Request, ScheduledChunk], budget: int, now: float) -> int:
        """Admit waiting requests into `chunks` (policy order, never skipping the head);
        returns the token budget left."""
        while self.waiting and budget > 0 and self.num_seated < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self._held_by_backoff(request, now):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            background = self.preemption.async_restore and request.kv_location == "host"
            self._background_reuses = False
            fits = self._whole_sequence_fits(request) and self._allocate_for(request, num_new, background)
            if not fits and self._reclaim_prefetched(request, num_new):
                fits = self._whole_sequence_fits(request) and self._allocate_for(request, num_new, background)
            if not fits:
                break  # never skip the head
            self.waiting.pop()
            if background:
                request.kv_location = None
                if self._restore_in_background(request, now):
                    continue  # READY: no chunk, no token budget until it joins
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            elif request.kv_location == "host":
                self.host.restore(request, now)  # may lower num_computed_tokens (fallback, warm-up)
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            elif request.kv_location == "device":
                self.paused.remove(request)  # zero copy: its blocks never left
            request.kv_location = None
            self._seat(request)
            chunks[request] = ScheduledChunk(request, num_new)
            budget -= num_new
        return budget

    def _restore_in_background(self, request: Request, now: float) -> bool:
        """Start an async restore of an admitted request (its blocks allocated). True: it
        waits READY out of the batch; False: nothing to wait for (its copy-in, done ahead,
        has ended, or the copy was unusable and it recomputes), it joins now."""
        result = self.host.restore(request, now, background=True)
        ready_s = now + result.restore_s if result.ok else now
        if self._background_reuses:  # its blocks may still be copying out: wait for that too
            ready_s = max(ready_s, self.copy_out.end_s)
        if ready_s <= now:
            if self._background_reuses:  # it computes in this step, in blocks copying out
                self._batch_reuses_copy_out = True
            return False
        request.state = RequestState.READY
        self.restores.start(request, ready_s, now)
        return True

    def _held_by_backoff(self, request: Request, now: float) -> bool:
        """After a preemption failure, requests that never ran wait for the backoff;
        preempted ones may resume (they already hold host or device memory)."""
        return self.gate.holds(now, fresh=request.state is RequestState.WAITING)

    def settle_saves(self) -> None:
        """Copy the stored sizes the mover's workers have reported since into their
        records (the engine calls it once more after stopping the workers)."""
        self.host.settle()

    # ----------------------------------------------------------------- blocks
    def _admission_missing_blocks(self, request: Request) -> int:
        """Blocks a waiting request must find free to be admitted: for its whole current
        sequence with `reserve_full_sequence` (vLLM 0.32's `scheduler_reserve_full_isl`,
        `full_sequence_must_fit` in `KVCacheManager.allocate_slots`), else for its first
        chunk only."""
        if self.config.reserve_full_sequence:
            num_tokens = request.num_tokens
        else:
            num_tokens = request.num_computed_tokens + min(
                request.num_tokens - request.num_computed_tokens, self.config.max_num_batched_tokens
            )
        return blocks_needed(num_tokens, self.block_size) - len(request.block_ids)

    def _whole_sequence_fits(self, request: Request) -> bool:
        """The admission gate for the whole sequence (a no-op without reserve_full_sequence:
        the first chunk's allocation is the only check then)."""
        if not self.config.reserve_full_sequence:
            return True
        num_missing = self._admission_missing_blocks(request)
        if num_missing <= 0 or self.block_pool.can_allocate(num_missing):
            return True
        self._reclaim_paused(num_missing, exclude=request)
        return self.block_pool.can_allocate(num_missing)

    def _allocate_for(self, request: Request, num_new: int, background: bool = False) -> bool:
        """Grow the request's block table to cover `num_new` more tokens, if possible,
        reclaiming paused requests' blocks first. `background`: for an async restore (not
        this step's batch: a reuse of copied-out blocks does not make the batch wait)."""
        num_tokens = request.num_computed_tokens + num_new
        if num_tokens <= len(request.block_ids) * self.block_size:
            return True  # most calls: a decode step within its last block
        num_missing = blocks_needed(num_tokens, self.block_size) - len(request.block_ids)
        if not self.block_pool.can_allocate(num_missing):
            self._reclaim_paused(num_missing, exclude=request)
            if not self.block_pool.can_allocate(num_missing):
                return False
        self.copy_out.allocating(self.block_pool.num_free - num_missing)
        # Counted by block numbers, reuse is monotone within a step: once an allocation
        # dips into copied-out blocks, every later one does too.
        if self.copy_out.is_reused:
            if background:
                self._background_reuses = True
            else:
                self._batch_reuses_copy_out = True
        request.block_ids.extend(self.block_pool.allocate(num_missing))
        return True

    def _reclaim_paused(self, num_missing: int, exclude: Request) -> None:
        """Data moves only now: save paused requests (least important first) until
        `num_missing` blocks are free or nobody is left paused."""
        while not self.block_pool.can_allocate(num_missing):
            candidates = [r for r in self.paused if r is not exclude]
            if not candidates:
                return
            victim = self.policy.select_victim(candidates, self._now)
            self.paused.remove(victim)
            record = PreemptionRecord(
                self._now, victim.request_id, "reclaim", "save", victim.num_computed_tokens
            )
            self.records.append(record)
            failure = self.host.save(victim, self.preemption.reclaim_codec, record, self._now)
            self._free_after_save(victim, record, failure)
            self.waiting.rescore(victim)  # still waiting; its KV may be gone
            if failure is not None:  # a reclaim: blocks were needed
                self._fail(victim, record, failure, forced=True)

    def _reclaim_prefetched(self, head: Request, num_new: int) -> bool:
        """Cancel restore prefetches of requests queued behind `head` (last in admission
        order first) until `head` could be admitted; True if any was cancelled.

        Why: a prefetch holds blocks for a request that is not admitted yet; a request
        that arrived since, or one ranked ahead of it, must not wait for them (with
        nothing running, nobody would ever free them). A prefetched request is a waiting
        one whose KV is on the host and whose blocks are already its own."""
        if self.mover is None:  # recompute: no host copies, so nothing is prefetched
            return False
        held = self.waiting.in_order(
            lambda r: r is not head and r.kv_location == "host" and bool(r.block_ids)
        )
        need = max(
            self._admission_missing_blocks(head),
            blocks_needed(head.num_computed_tokens + num_new, self.block_size) - len(head.block_ids),
        )
        cancelled = False
        while held and not self.block_pool.can_allocate(need):
            request = held.pop()
            self.mover.cancel_prefetch(request)
            self._release_blocks(request)
            cancelled = True
        return cancelled

    def _free_after_save(self, victim: Request, record: PreemptionRecord, failure: str | None) -> None:
        """Free the victim's blocks; its KV now lives on the host, or (failed save) is
        dropped and will be recomputed from its tokens."""
        num_blocks = len(victim.block_ids)
        self._release_blocks(victim)
        if failure is None and victim.num_computed_tokens:
            self.host.keep(victim, record, num_blocks)
        else:
            record.action = "recompute"
            victim.kv_location = None
            recompute_from_scratch(victim)

    # ----------------------------------------------------------------- preemption
    def _memory_candidates(self) -> list[Request]:
        """Victims for a forced preemption: PREEMPTION_FAILED requests only as a last resort."""
        return [r for r in self.running if not r.preemption_failed] or self.running

    def _priority_preemption(self, now: float) -> Request | None:
        if not self.waiting:
            return None
        challenger = self.waiting.peek()
        if self._can_admit(challenger):
            return None
        return self.gate.priority_victim(
            challenger,
            self.running,
            now,
            fresh=challenger.state is RequestState.WAITING,
            take=lambda victim: self._preempt(victim, "priority", forced=False, challenger=challenger),
        )

    def _can_admit(self, request: Request) -> bool:
        if self.num_seated >= self.config.max_num_seqs:
            return False
        num_missing = self._admission_missing_blocks(request)
        reclaimable = sum(len(r.block_ids) for r in self.paused if r is not request)
        return num_missing <= self.block_pool.num_free + reclaimable

    def _preempt(
        self, victim: Request, reason: str, *, forced: bool, challenger: Request | None = None
    ) -> bool:
        """Take `victim` out of the batch. Returns False when the fallback kept it running."""
        mode = self.preemption.mode
        record = PreemptionRecord(
            self._now,
            victim.request_id,
            reason,
            "recompute",
            victim.num_computed_tokens,
            challenger_id=challenger.request_id if challenger is not None else None,
            slice_used_s=victim.slice_used_s,
            slice_s=time_slice_s(victim, self.preemption),
        )
        self.records.append(record)
        if not forced and self.gate.over_consecutive_limit(victim):
            self._fail(victim, record, "consecutive_limit", forced=False)
            return False
        failure = None
        if mode == "pause" and not forced:
            record.action = "pause"
            victim.kv_location = "device"
            self.paused.append(victim)
        elif mode == "recompute":
            self._release_blocks(victim)
            recompute_from_scratch(victim)
            victim.kv_location = None
        else:
            # A forced preemption must free the blocks, so `pause` saves here too.
            record.action = "save"
            codec = save_codec(mode, self.preemption.reclaim_codec)
            failure = self.host.save(victim, codec, record, self._now)
            if failure is not None and not forced:
                self._fail(victim, record, failure, forced=False)  # keeps running with its KV
                return False
            self._free_after_save(victim, record, failure)
        self.running.remove(victim)
        victim.state = RequestState.PREEMPTED
        victim.num_preemptions += 1
        victim.slice_used_s = 0.0
        self.num_preemptions += 1
        self.gate.on_preempted(self._now, forced)
        self.add_request(victim)
        # Forced: memory had to be freed now (its KV dropped if the save failed). Either
        # way it is flagged after leaving `running`, so the record keeps its action.
        if failure is not None:  # only a forced one gets here with a failed save
            self._fail(victim, record, failure, forced=True)
        elif forced and self.gate.over_consecutive_limit(victim):
            # It has paid enough: from now on only a victim of last resort.
            self._fail(victim, record, "consecutive_limit", forced=True)
        return True

    def _fail(self, request: Request, record: PreemptionRecord, failure: str, *, forced: bool) -> None:
        """A preemption could not go as planned (`failure` says why; `forced`: one made
        because blocks ran out). With the design's fallback (docs/design.md §7): mark
        PREEMPTION_FAILED (runs to completion, never a priority victim again) and back new
        admissions off exponentially (`PreemptionGate.on_failure`). Without it (the
        baselines), only the record says what happened."""
        record.failure = failure
        is_running = request in self.running
        if is_running:
            record.action = "none"  # kept running with its KV
        if self.gate.on_failure(request, self._now, forced):
            self.num_preemption_failed += 1
        if is_running and self.uses_failure_fallback:
            request.state = RequestState.PREEMPTION_FAILED

    # ----------------------------------------------------------------- exits
    def finish_request(self, request: Request, state: RequestState) -> None:
        """Take a running or waiting request out for good and free its blocks and host copy."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.restores:  # READY: its KV already in its blocks
            self.restores.remove(request)
        else:
            self.waiting.discard(request)
            if request in self.paused:
                self.paused.remove(request)
            if request.kv_location == "host":
                self.host.forget(request)
        if self.mover is not None:  # its host copy, and any early (speculative) copies
            self.mover.discard(request)
        request.kv_location = None
        self._release_blocks(request)
        request.state = state

    def _remove_finished(self, finished: list[Request]) -> None:
        """Batch version of `finish_request(r, FINISHED)` for running requests (one pass
        over the running list per step instead of one per request)."""
        if not finished:
            return
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for request in finished:
            self._release_blocks(request)
            request.state = RequestState.FINISHED

    def _release_blocks(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
