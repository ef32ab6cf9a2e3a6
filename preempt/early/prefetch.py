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
restore into them (`EngineView.prefetch`, the saver's `Saver.prefetch`). A head of the
queue that cannot be admitted otherwise takes prefetched blocks back (the scheduler
cancels prefetches behind it), so a prefetch never keeps anyone waiting. Bounded by
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
    from preempt.core.request import Request
    from preempt.engine.view import EngineView, StepOutput


class Prefetcher:
    """`hook(view, output)` after each engine step: decode ahead, then copy in ahead."""

    def __init__(self, config: EarlySaveConfig) -> None:
        self.depth = config.prefetch_depth
        self.block_share = config.prefetch_block_share
        self.host_budget = config.prefetch_host_budget
        self.num_cancelled = 0
        # Lead of copy-ins ahead: a copy-in started by the hook right before
        # the admission's schedule() had no compute to overlap with (0 steps of lead).
        self._started: dict[int, tuple[Request, int]] = {}  # id(request) -> (it, num_steps at start)
        self.num_admitted = 0
        self.num_admitted_without_lead = 0

    def stats(self) -> dict[str, int]:
        """Prefetched copy-ins claimed by an admission, and those of them started in the
        hook right before it (no step ran between: the copy-in could hide nothing)."""
        return {
            "num_prefetch_admitted": self.num_admitted,
            "num_prefetch_admitted_without_lead": self.num_admitted_without_lead,
            "num_prefetch_cancelled": self.num_cancelled,
        }

    def _count_leads(self, view: EngineView) -> None:
        running = {id(r) for r in view.running} | {id(r) for r in view.restoring}  # admitted
        prefetched = {id(r) for r in view.prefetched_requests}
        for key, (_request, started_step) in list(self._started.items()):
            if key in running:  # admitted in the step just run: its restore claimed the copy
                self.num_admitted += 1
                self.num_admitted_without_lead += view.num_steps - 1 == started_step
                del self._started[key]
            elif key not in prefetched:  # cancelled or aborted
                del self._started[key]

    @staticmethod
    def headroom(view: EngineView) -> int:
        """Blocks the running requests take in the next step, if it runs them all (their
        next decode token or prefill chunk within the token budget): kept free, so a
        prefetch never makes the next step preempt anyone for memory."""
        budget = view.max_num_batched_tokens
        need = 0
        for request in view.running:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            budget -= num_new
            num_blocks = blocks_needed(request.num_computed_tokens + num_new, view.block_size)
            need += max(0, num_blocks - len(request.block_ids))
        return need

    def __call__(self, view: EngineView, output: StepOutput) -> None:
        self._count_leads(view)
        candidates = [r for r in view.next_to_admit(self.depth) if r.kv_location == "host"]
        # Phase 1: host decode ahead (no device blocks needed), within the host budget.
        decoded = view.predecode_bytes_held
        for request in candidates:
            if view.is_predecoded(request) or not view.needs_decode(request):
                continue
            nbytes = view.saved_bytes(request)
            if decoded + nbytes > self.host_budget:
                break
            decoded += view.predecode(request)
        # Phase 2: the host-to-device copy into free blocks, keeping the next step's need free.
        headroom = self.headroom(view)
        order = {id(r): i for i, r in enumerate(candidates)}
        held = sorted(view.prefetched_requests, key=lambda r: order.get(id(r), len(order)))
        while held and view.num_free_blocks < headroom:  # cancel, last in admission order first
            view.cancel_prefetch(held.pop())
            self.num_cancelled += 1
        num_held = sum(len(r.block_ids) for r in held)
        limit = int(self.block_share * view.num_blocks)
        for request in candidates:
            if view.is_prefetched(request):
                continue
            num_missing = blocks_needed(request.num_computed_tokens, view.block_size) - len(request.block_ids)
            if num_held + num_missing > limit or view.num_free_blocks - num_missing < headroom:
                break  # in admission order: never skip ahead of someone who does not fit
            num_held += view.prefetch(request)
            self._started[id(request)] = (request, view.num_steps)
