"""Victims' KV on the host: the scheduler's side of a save and a restore.

The scheduler decides who is preempted and when a saved request resumes; this class
carries out those two decisions through the `KVMover` (the saver, which owns the bytes)
and writes what happened into the victim's `PreemptionRecord`: the save's sizes and
times, the record each saved request resumes from, the stored size a worker reports
later (settled at the next step), and a restore's outcome (a lossy one's warm-up tokens,
or a fallback to recompute). Plain Python.
"""

from __future__ import annotations

from preempt.core.request import Request
from preempt.kv.copy_out import CopyOut
from preempt.kv.record import KVMover, PreemptionRecord, RestoreResult, StoredSizes


class HostCopies:
    def __init__(self, mover: KVMover | None, copy_out: CopyOut) -> None:
        self.mover = mover
        self.copy_out = copy_out  # blocks freed by saves whose copy-out may still run
        self._records: dict[Request, PreemptionRecord] = {}  # the save each one resumes from
        self._stored_sizes = StoredSizes()
        self.num_restore_fallbacks = 0

    def save(self, victim: Request, codec: str, record: PreemptionRecord, now: float) -> str | None:
        """Save the victim's KV through the mover; the failure reason, or None."""
        record.codec = codec
        if not victim.num_computed_tokens:
            return None  # nothing computed yet, nothing to save
        result = self.mover.save(victim, codec, now)
        if result.failure is None:
            record.bytes_raw = result.bytes_raw
            record.bytes_early = result.bytes_early
            record.save_s = result.save_s
            self.copy_out.saved(result.copy_end_s)
            self._stored_sizes.add(record, result.bytes_stored)
        return result.failure

    def keep(self, victim: Request, record: PreemptionRecord, num_blocks: int) -> None:
        """The victim's save stands and its `num_blocks` blocks were freed: it resumes from
        the host copy, whose copy-out runs until it ends."""
        victim.kv_location = "host"
        self._records[victim] = record
        self.copy_out.freed(num_blocks)

    def restore(self, request: Request, now: float, background: bool = False) -> RestoreResult:
        """Bring a saved request's KV back into its (allocated) blocks; an unusable copy
        falls back to recomputing it, a lossy one recomputes its last tokens."""
        record = self._records.pop(request)
        result = self.mover.restore(request, now, background=background)
        record.restored = result.ok
        record.warmup_tokens = result.warmup_tokens
        record.restore_s = result.restore_s
        self.settle()  # the worker is done with this copy: its size is known now
        if not result.ok:
            self.num_restore_fallbacks += 1
            recompute_from_scratch(request)
        else:  # a lossy restore's last tokens are recomputed at full precision
            request.num_computed_tokens -= result.warmup_tokens
        return result

    def forget(self, request: Request) -> None:
        """A saved request that will never resume (aborted while waiting)."""
        self._records.pop(request, None)

    def settle(self) -> None:
        """Copy the stored sizes the mover's workers have reported since into their records."""
        self._stored_sizes.settle()


def recompute_from_scratch(request: Request) -> None:
    """The request's KV is gone: it will be recomputed from token 0 at full precision, so
    no head's prefix stays masked."""
    request.num_computed_tokens = 0
    request.kv_masked_until = None
