"""Restore prefetch: start restoring the next requests to be admitted before they are.

Why: in the swap modes the restore stall dwarfs the save stall (`preempt bench early`:
~28 s of restore stall against ~0.3 s of save stall on the collect workload), and an
early save cannot hide a restore. The scheduler knows whom it admits next
(`Scheduler.next_to_admit`), so their host copies can stream back (host decode, then the
host-to-device copy) while compute goes on, and a resumed request finds its KV ready.

Owns: the choice of whom to prefetch and the blocks held for them. After each engine
step, for the first `prefetch_depth` waiting requests in admission order whose KV is on
the host: allocate the blocks that cover their computed tokens (they become the
request's own `block_ids`, which the scheduler then counts as held at admission) and
ask the saver to restore into them (`Saver.prefetch`). Bounded by
`prefetch_block_share` of the pool and by a headroom of free blocks kept for the running
requests' next step (one block each, plus one step's token budget); when free blocks
fall under that headroom, prefetches are cancelled, last in admission order first (their
blocks freed, the host copy kept: only the copy-in is wasted).

Accounting (exact after every step, a property test): every prefetch ends used (claimed
by the restore at admission), wasted (cancelled, or the request aborted) or is held now:
`prefetch_bytes == used + wasted + held`, and the blocks held are exactly the prefetched
requests' blocks. Lossless outputs never change: the bytes written are the ones the
restore would write, into blocks nobody else holds.

Must never: prefetch on the wall clock (configs refuse it), touch a running request, or
hand blocks to anyone but the prefetched request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from preempt.core.block_pool import blocks_needed
from preempt.core.config import EarlySaveConfig

if TYPE_CHECKING:
    from preempt.engine.step import EngineView, StepOutput


class Prefetcher:
    """`hook(engine, output)` after each engine step: decode ahead, then copy in ahead."""

    def __init__(self, config: EarlySaveConfig) -> None:
        self.depth = config.prefetch_depth
        self.block_share = config.prefetch_block_share
        self.host_budget = config.prefetch_host_budget
        self.num_cancelled = 0

    @staticmethod
    def headroom(engine: EngineView) -> int:
        """Blocks the running requests take in the next step, if it runs them all (their
        next decode token or prefill chunk within the token budget): kept free, so a
        prefetch never makes the next step preempt anyone for memory."""
        scheduler = engine.scheduler
        budget = scheduler.config.max_num_batched_tokens
        need = 0
        for request in scheduler.running:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            budget -= num_new
            need += max(
                0,
                blocks_needed(request.num_computed_tokens + num_new, engine.block_size)
                - len(request.block_ids),
            )
        return need

    def __call__(self, engine: EngineView, output: StepOutput) -> None:
        saver, pool, scheduler = engine.saver, engine.block_pool, engine.scheduler
        now = engine.clock.now()
        candidates = [r for r in scheduler.next_to_admit(self.depth) if r.kv_location == "host"]
        # Phase 1: host decode ahead (no device blocks needed), within the host budget.
        decoded = saver.ahead.predecode_bytes_held
        for request in candidates:
            if saver.is_predecoded(request) or not saver.needs_decode(request):
                continue
            nbytes = saver.saved_bytes(request)
            if decoded + nbytes > self.host_budget:
                break
            decoded += saver.predecode(request, now)
        # Phase 2: the host-to-device copy into free blocks, keeping the next step's need free.
        headroom = self.headroom(engine)
        order = {id(r): i for i, r in enumerate(candidates)}
        held = sorted(saver.prefetched_requests, key=lambda r: order.get(id(r), len(order)))
        while held and pool.num_free < headroom:  # cancel, last in admission order first
            self._cancel(engine, held.pop())
        num_held = sum(len(r.block_ids) for r in held)
        limit = int(self.block_share * pool.num_blocks)
        for request in candidates:
            if saver.is_prefetched(request):
                continue
            num_missing = blocks_needed(request.num_computed_tokens, engine.block_size) - len(
                request.block_ids
            )
            if num_held + num_missing > limit or pool.num_free - num_missing < headroom:
                break  # in admission order: never skip ahead of someone who does not fit
            request.block_ids.extend(pool.allocate(num_missing))
            saver.prefetch(request, now)
            num_held += num_missing

    def _cancel(self, engine: EngineView, request) -> None:
        engine.saver.cancel_prefetch(request)
        engine.block_pool.free(request.block_ids)
        request.block_ids = []
        self.num_cancelled += 1
