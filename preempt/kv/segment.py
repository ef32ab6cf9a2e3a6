"""A host copy of a request's KV, as the saver keeps it: one or more blobs (segments).

Owns: `Segment` (one blob: its token range, codec, sizes, where it lives in the host pool
and, on the virtual clock, when its copy-out and encode end), `SavedCopy` (the segments
a preempted request resumes from) and the small helpers around a blob still on a worker
thread: its slot handle and its stored size are futures until the worker is done.

Plain data and futures; it moves nothing (preempt.kv.saver does).
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

from preempt.kv.host_pool import SlotHandle


def done_future(value: int = 0) -> Future:
    """A future that already holds `value` (a size known at once, or nothing stored)."""
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass
class Segment:
    """One blob on the host: tokens [start, start + num_tokens) of a request's KV. A save is
    one segment, or, after early saves, the early segments plus the tail written since."""

    handle: SlotHandle | Future | None  # a Future while the worker is still encoding
    codec: str
    start: int  # first token; block-aligned
    num_tokens: int
    nbytes_raw: int
    ready_at_s: float  # virtual: when the host copy is complete
    speculative: bool = False  # an early save not (yet) claimed by a preemption
    # The blob's size in the pool, set by whoever stores it (a worker on the wall clock);
    # 0 when nothing was stored (an empty segment, or a store the worker lost).
    stored: Future = field(default_factory=Future)
    copy_end_s: float = 0.0  # virtual: when its device-to-host copy ends (blocks reusable)

    def __deepcopy__(self, memo: dict) -> Segment:
        # The lookahead's fork (virtual clock: every size is known) copies segments; a
        # Future holds a lock and cannot be copied, so the copy gets a done one.
        new = object.__new__(Segment)
        memo[id(self)] = new
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "stored":
                value = done_future(value.result(timeout=0))
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, f.name, value)
        return new


@dataclass
class SavedCopy:
    """The host copy a preempted request resumes from (the saver is its only owner)."""

    segments: list[Segment]
    num_tokens: int


def gather_stored(segments: list[Segment]) -> Future:
    """One future for the total stored bytes of `segments`, done when all of theirs are
    (at once on the virtual clock; on the wall clock when the last worker stores)."""
    total: Future = Future()
    pending = [segment.stored for segment in segments]
    if not pending:
        total.set_result(0)
        return total
    # The callback sums as the futures finish rather than reading `pending` at the end: a
    # pending future keeps its callbacks, so a callback that held `pending` would be a
    # reference cycle (future -> callback -> pending -> future) left to the cyclic GC.
    left = [len(pending), 0]  # futures not done yet, bytes of those done
    lock = threading.Lock()

    def on_done(future: Future) -> None:
        with lock:
            left[0] -= 1
            left[1] += future.result()
            last = left[0] == 0
        if last:
            total.set_result(left[1])

    for future in pending:
        future.add_done_callback(on_done)
    return total


def resolve(handle: SlotHandle | Future | None) -> SlotHandle | None:
    """The slot of a blob, waiting for its worker if it is still encoding."""
    return handle.result() if isinstance(handle, Future) else handle


def in_flight(segment: Segment, now: float) -> bool:
    handle = segment.handle  # read once: the early worker may replace it meanwhile
    return not handle.done() if isinstance(handle, Future) else segment.ready_at_s > now


# Header and zstd framing above the payload: the header is 36 + 8 * ndim bytes; zstd adds
# 3 bytes per 128 KB block of incompressible data (ZSTD_compressBound), bounded here by
# 1/1024 of the payload.
_HEADER_SLACK = 4096


def blob_bound(payload_nbytes: int) -> int:
    return payload_nbytes + payload_nbytes // 1024 + _HEADER_SLACK
