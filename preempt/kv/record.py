"""What a preemption did to a request's KV, and the interface that moves it.

Owns: `PreemptionRecord` (one preemption decision: its reason, what happened to the KV,
its bytes and timing; the row of preemptions.parquet), `is_preemption` (the one
definition of a record that took a request out of the batch), `KVMover` (the acting side
of save/restore that the scheduler calls: the saver implements it), and its results
`SaveResult` and `RestoreResult`. Which codec each `preemption.mode` saves with is
`preempt.core.registry.PREEMPTION_MODES` (`save_codec`).

One owner per record: the scheduler creates it and alone writes it, from the results a
`KVMover` returns. What a save's worker thread learns later (the stored size) comes as a
`concurrent.futures.Future` in the `SaveResult`; the scheduler copies it into the record
once it is done (`Scheduler.settle_saves`), on its own thread. Plain Python, no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from preempt.core.request import Request


def is_preemption(reason: str, action: str) -> bool:
    """Whether a record (or a preemptions.parquet row) took a running request out of the
    batch: a `priority` or `memory` decision that did not keep its victim running (action
    "none": the fallback kept it). A `reclaim` is the deferred save of a request already
    paused, counted at its pause. Exactly what `Scheduler.num_preemptions` counts; the one
    definition metrics, labels, the lookahead and the reports use."""
    return reason != "reclaim" and action != "none"


@dataclass
class PreemptionRecord:
    """One preemption decision (or failed attempt, or deferred reclaim of a paused one)."""

    time_s: float
    request_id: int
    reason: str  # "priority" | "memory" | "reclaim"
    action: str  # what happened to the KV: "recompute" | "save" | "pause" | "none" (failed, kept running)
    num_tokens: int  # tokens of KV the victim had
    challenger_id: int | None = None
    slice_used_s: float = 0.0  # the victim's executed time since it last started running
    slice_s: float = 0.0  # its time slice at the decision
    # Why the fallback was taken: "pool_full" | "blob_too_large" | "consecutive_limit". With
    # action "none" the victim kept running; otherwise (a forced preemption) it was still
    # preempted and is now PREEMPTION_FAILED: protected from later preemptions.
    failure: str | None = None
    codec: str | None = None
    bytes_raw: int = 0  # a save's bytes copied at the preemption
    bytes_early: int = 0  # bytes an early save had already copied (not copied again)
    bytes_stored: int = 0  # host-pool bytes of the save; 0 until its worker has stored it
    save_s: float = 0.0
    restore_s: float = 0.0
    restored: bool | None = None  # None: not (yet) restored; False: fell back to recompute
    warmup_tokens: int = 0  # lossy restore: last tokens recomputed at full precision

    @property
    def is_preemption(self) -> bool:
        """It took a running request out of the batch (`is_preemption` above)."""
        return is_preemption(self.reason, self.action)


class SaveResult(NamedTuple):
    """What a save did: `failure` None on success, else why the host copy was not kept
    (then nothing else is set)."""

    failure: str | None
    bytes_raw: int = 0  # copied at the preemption
    bytes_early: int = 0  # already on the host from early saves (claimed, not copied again)
    save_s: float = 0.0  # virtual: until the host copy is complete; wall: the engine thread's share
    copy_end_s: float = 0.0  # virtual: when its device-to-host copies end (preempt.kv.copy_out)
    # The blob sizes in the host pool, once stored: at once on the virtual clock, from the
    # worker thread on the wall clock. None: nothing was saved (a failure).
    bytes_stored: Future | None = None


class RestoreResult(NamedTuple):
    """What a restore did: `ok` False if the saved copy was unusable (recompute)."""

    ok: bool
    warmup_tokens: int = 0  # lossy restore: last tokens to recompute at full precision
    restore_s: float = 0.0  # virtual: until compute may use the KV; wall: engine thread time


class StoredSizes:
    """Records whose save's stored size a worker has yet to report (a future each):
    `settle` copies in the sizes reported since (the scheduler calls it each step and
    once more after the workers stop)."""

    def __init__(self) -> None:
        self._pending: list[tuple[PreemptionRecord, Future]] = []

    def add(self, record: PreemptionRecord, stored: Future) -> None:
        if stored.done():  # always on the virtual clock
            record.bytes_stored = stored.result()
        else:
            self._pending.append((record, stored))

    def settle(self) -> None:
        if self._pending:
            still = []
            for record, stored in self._pending:
                if stored.done():
                    record.bytes_stored = stored.result()
                else:
                    still.append((record, stored))
            self._pending = still


class KVMover(ABC):
    """The acting side of save/restore, called synchronously at decision time.

    Rules: `save` copies the KV of the request's first `num_computed_tokens` tokens out of
    `request.block_ids` into host memory and returns what it did; it must not touch the
    blocks' ownership (the scheduler frees them right after). The host copy is the
    mover's alone until `restore` (called once the request's blocks cover
    `num_computed_tokens` again) writes it into them and frees it; a lossy restore also
    marks the request's dropped heads and returns the `warmup_tokens` the scheduler
    recomputes. Neither raises on load conditions: the result says what went wrong.
    Neither writes a `PreemptionRecord`: the scheduler does, from the results.
    """

    @abstractmethod
    def save(self, request: Request, codec: str, now: float) -> SaveResult:
        """Save the KV (on failure the host copy is not kept)."""

    @abstractmethod
    def restore(self, request: Request, now: float, *, background: bool = False) -> RestoreResult:
        """Restore the KV (the host copy is freed either way). `background` (virtual
        clock, `preemption.async_restore`): compute does not wait for this copy-in (the
        scheduler keeps the request out of the batch until `now + restore_s`)."""

    def cancel_prefetch(self, request: Request) -> None:  # noqa: B027 (optional)
        """Forget a restore started before admission (its blocks are freed by the caller;
        the host copy stays). Only a mover that prefetches has any."""

    @abstractmethod
    def discard(self, request: Request) -> None:
        """Drop a saved copy that will never be restored (the request was aborted)."""
