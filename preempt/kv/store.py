"""Host copies of requests' KV: the one home of a saved copy, for the engine and the vLLM connector.

Owns:
- `Segment`: one blob on the host, tokens `[start, start + num_tokens)` of a request's KV:
  its codec, sizes, where it lives in the host pool (a future while a worker encodes it),
  why it could not be stored, and, on the engine's virtual clock, when its copy-out and
  encode end. `SavedCopy`: the segments a preempted request resumes from.
- `Worker`: one encode thread. A save's gather runs on the caller's thread (the blocks may
  be reused once it returns); its encode and store run on a worker, so the compression
  overlaps the next forward pass.
- `HostStore`: the host pool and the codecs by name; saves one segment out of a paged
  cache into a blob (at once, or on a worker) and restores it into new blocks, counting
  the stored bytes exactly.
- `CopiesById`: copies by request id, one segment after another (an early copy, then the
  rest), with what each finished store and load cost (`CopyReport`): what the vLLM
  connector keeps. The engine's saver keeps its own copies (by request, with early
  copies and restores ahead: preempt.kv.saver) over the same `HostStore`.

Acting code: it moves bytes when told to; who is saved or restored is decided elsewhere.
A segment that cannot be stored (a full pool, a blob over the largest allowed, a failed
encode) says why (`error`); one that fails to decode raises CorruptBlobError: nothing
partial is ever restored.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import numpy as np

from preempt.kv.codec import Codec, CorruptBlobError, PagedCache
from preempt.kv.host_pool import BlobHandle, HostPool, HostPoolError, PreemptionHandlerOOM


def done_future(value: int = 0) -> Future:
    """A future that already holds `value` (a size known at once, or nothing stored)."""
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass
class Segment:
    """One blob on the host: tokens [start, start + num_tokens) of a request's KV. A save is
    one segment, or, after early saves, the early segments plus the tail written since."""

    start: int  # first token; block-aligned
    num_tokens: int
    codec: str
    handle: BlobHandle | Future | None = None  # a Future while a worker is still encoding
    nbytes_raw: int = 0
    # The blob's size in the pool, set by whoever stores it (a worker on the wall clock);
    # 0 when nothing was stored (an empty segment, or a store that failed: `error` says why).
    stored: Future = field(default_factory=Future)
    error: str | None = None  # "pool_full", "blob_too_large", "closed", "encode: ..."
    seconds: float = 0.0  # wall clock: from the gather until the blob was stored
    # The engine's virtual clock (preempt.kv.timing):
    ready_at_s: float = 0.0  # when the host copy is complete
    copy_end_s: float = 0.0  # when its device-to-host copy ends (blocks reusable)
    speculative: bool = False  # an early save not (yet) claimed by a preemption

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

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
    """The host copy a preempted request resumes from: its segments, in token order."""

    segments: list[Segment] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.segments[-1].end if self.segments else 0


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


def resolve(handle: BlobHandle | Future | None) -> BlobHandle | None:
    """The pool handle of a blob, waiting for its worker if it is still encoding."""
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


class Worker:
    """One encode thread: tasks run in submission order."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, task: Callable[[], object]) -> Future:
        return self._pool.submit(task)

    def close(self) -> None:
        """Wait for every queued task, then stop. Idempotent."""
        self._pool.shutdown(wait=True)


class HostStore:
    """The host pool and the codecs (name -> instance) that fill it, one segment at a time."""

    def __init__(self, pool: HostPool, codecs: Mapping[str, Codec]) -> None:
        self.pool = pool
        self.codecs = codecs  # read, never copied: an engine's builds a codec on first use
        self._lock = threading.Lock()  # the stored-byte count, written by the workers too
        self.bytes_stored = 0

    def __deepcopy__(self, memo: dict[int, object]) -> HostStore:
        """A model of this store (an engine fork's, virtual clock): the pool's extents and
        the byte count copied, the codecs shared."""
        copied = object.__new__(HostStore)
        memo[id(self)] = copied
        copied.pool = copy.deepcopy(self.pool, memo)
        copied.codecs = self.codecs
        copied._lock = threading.Lock()
        copied.bytes_stored = self.bytes_stored
        return copied

    # ----------------------------------------------------------------- saving
    def save(
        self, segment: Segment, cache: PagedCache, block_ids: Sequence[int], worker: Worker | None = None
    ) -> str | None:
        """Copy the segment's tokens out of `cache` now (the codec's device side), then encode
        and store them: now, or on `worker`, for which the blob's largest size is reserved now
        so that a failure is known at once. The reason the pool cannot take it, or None;
        the blob's size comes through `segment.stored`."""
        began = time.perf_counter()
        codec = self.codecs[segment.codec]
        segment.nbytes_raw = cache.raw_nbytes(segment.num_tokens)
        gathered = codec.gather(cache, block_ids, segment.start, segment.num_tokens)
        if worker is None:
            segment.handle = self._store(segment, codec, gathered, began)
            return segment.error
        try:
            reservation = self.pool.reserve(blob_bound(_nbytes(gathered)))
        except PreemptionHandlerOOM as err:
            segment.error = err.reason
            segment.stored.set_result(0)
            return err.reason

        def work() -> BlobHandle | None:  # None: lost (pool) or failed (encode): the restore recomputes
            try:
                return self._store(segment, codec, gathered, began, into=reservation)
            finally:
                if not segment.stored.done():  # nothing stored
                    segment.stored.set_result(0)

        segment.handle = worker.submit(work)  # the handle is this future's result
        return None

    def _store(
        self, segment: Segment, codec: Codec, gathered: object, began: float, into: BlobHandle | None = None
    ) -> BlobHandle | None:
        """Encode and store the segment's blob (into the reserved extent `into`, if given):
        its handle, or None with the reason in `segment.error`. No failure escapes: a
        worker's must fail this copy, not the thread."""
        try:
            parts = codec.encode_gathered(gathered)
        except Exception as err:
            if into is not None:
                self.pool.free(into)
            segment.error = f"encode: {type(err).__name__}: {err}"
            return None
        try:
            handle = self.pool.store(parts, into=into)  # releases `into` if it fails
        except PreemptionHandlerOOM as err:
            segment.error = err.reason
            return None
        except HostPoolError:  # closed meanwhile
            segment.error = "closed"
            return None
        segment.seconds = time.perf_counter() - began
        self.count_stored(segment, handle.nbytes)
        return handle

    def reserve(self, segment: Segment, nbytes: int) -> str | None:
        """Hold `nbytes` for a blob that exists only as a size (no KV data); the reason the
        pool cannot take it, or None."""
        try:
            segment.handle = self.pool.reserve(nbytes)
        except PreemptionHandlerOOM as err:
            segment.error = err.reason
            return err.reason
        self.count_stored(segment, segment.handle.nbytes)
        return None

    def count_stored(self, segment: Segment, nbytes: int) -> None:
        """The segment's blob is in the pool (workers call this too): count it, and report
        its size through the segment's future."""
        with self._lock:
            self.bytes_stored += nbytes
        segment.stored.set_result(nbytes)

    # ----------------------------------------------------------------- restoring
    def restore(self, segment: Segment, cache: PagedCache, block_ids: Sequence[int]) -> np.ndarray | None:
        """Decode the segment into the blocks of the request whose block table is
        `block_ids` (waiting for its worker first); the heads its codec could not restore
        (L, H), or None. Raises CorruptBlobError: not stored, corrupt, or not KV that fits."""
        handle = resolve(segment.handle)
        if handle is None:
            raise CorruptBlobError(
                f"segment [{segment.start}, {segment.end}) was not stored: {segment.error}"
            )
        codec = self.codecs[segment.codec]
        decoded = codec.decode_gathered(self.pool.load(handle))
        return codec.scatter(decoded, cache, block_ids, segment.start, segment.num_tokens)

    def free(self, segment: Segment) -> None:
        """Free the segment's blob (waiting for its worker if it is still storing)."""
        handle = resolve(segment.handle)
        if handle is not None:
            self.pool.free(handle)

    def close(self) -> None:
        """Free the host pool's buffer (join the workers first). Idempotent."""
        self.pool.close()


def _nbytes(gathered: object) -> int:
    """Bytes of what a codec's `gather` returned (a tensor, or a `QuantizedKV`)."""
    nbytes = getattr(gathered, "nbytes", None)
    return int(nbytes) if nbytes is not None else gathered.numel() * gathered.element_size()


@dataclass
class CopyReport:
    """What one finished store or load did and cost; `error` names why it failed, None
    when it did not."""

    num_tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class CopiesById:
    """Saved copies by request id over one `HostStore`, an encode `Worker` and a load one.

    `save` appends a segment (an early copy, then the tokens since) and hands its encode to
    the worker; `load` decodes the copy's segments into the request's new blocks and frees
    it (`load_later`: the same on a load thread); `finished` reports, once, each copy whose
    stores have all ended. A segment that cannot be stored fails the whole copy.
    """

    def __init__(self, store: HostStore, codec: str) -> None:
        self.store = store
        self.codec = codec
        self.copies: dict[str, SavedCopy] = {}
        # Copies with a store to report -> their first segment not yet reported.
        self._unreported: dict[str, int] = {}
        self._lock = threading.Lock()
        self._worker = Worker("preempt-kv-save")
        self._loader = Worker("preempt-kv-load")

    @property
    def pool(self) -> HostPool:
        return self.store.pool

    # ------------------------------------------------------------- saving
    def save(
        self, request_id: str, cache: PagedCache, block_ids: Sequence[int], start: int, end: int
    ) -> Segment:
        """Start storing tokens `[start, end)` as the next segment of `request_id`'s copy
        (`start` must be where the copy ends). Returns the segment; its handle (or its
        error) is set once `pending(request_id)` is False."""
        with self._lock:
            saved = self.copies.setdefault(request_id, SavedCopy())
            if saved.num_tokens != start:
                raise ValueError(
                    f"request {request_id}: copy holds {saved.num_tokens} tokens, segment starts at {start}"
                )
            segment = Segment(start, end - start, self.codec)
            self._unreported.setdefault(request_id, len(saved.segments))
            saved.segments.append(segment)
        self.store.save(segment, cache, block_ids, self._worker)
        return segment

    def touch(self, request_id: str) -> None:
        """Report this copy as finished once its segments in flight are (a victim whose
        early copy already holds every token has nothing more to store)."""
        with self._lock:
            saved = self.copies.get(request_id)
            self._unreported.setdefault(request_id, len(saved.segments) if saved else 0)

    def pending(self, request_id: str) -> bool:
        """A segment of this request's copy is still being encoded."""
        saved = self.copies.get(request_id)
        return saved is not None and any(_encoding(segment) for segment in saved.segments)

    def wait(self, request_id: str) -> None:
        saved = self.copies.get(request_id)
        for segment in saved.segments if saved else ():
            resolve(segment.handle)

    def finished(self) -> dict[str, float]:
        """Request id -> seconds of its slowest store since the last report, for the copies
        whose stores have all finished (each store reported once)."""
        out = {}
        with self._lock:
            for request_id, first in list(self._unreported.items()):
                saved = self.copies.get(request_id)
                if saved is None:
                    del self._unreported[request_id]
                elif not any(_encoding(segment) for segment in saved.segments):
                    out[request_id] = max((s.seconds for s in saved.segments[first:]), default=0.0)
                    del self._unreported[request_id]
        return out

    def stored(self, request_id: str) -> tuple[int, str | None]:
        """(tokens held, the failure if any segment failed) for a copy no longer pending."""
        saved = self.copies.get(request_id)
        if saved is None:
            return 0, "missing"
        error = next((s.error for s in saved.segments if s.error is not None), None)
        return saved.num_tokens, error

    def nbytes(self, request_id: str) -> tuple[int, int]:
        """(raw bytes, stored bytes) of a copy."""
        saved = self.copies.get(request_id)
        segments = saved.segments if saved else []
        return sum(s.nbytes_raw for s in segments), sum(
            s.stored.result() for s in segments if s.stored.done()
        )

    # ------------------------------------------------------------- loading
    def load(
        self, request_id: str, cache: PagedCache, block_ids: Sequence[int], start: int, end: int
    ) -> CopyReport:
        """Decode tokens `[start, end)` of the copy into the request's blocks, then free the
        copy. Raises CorruptBlobError (a failed checksum, a missing or short copy); the copy
        is freed either way. `cache` is written only in `[start, end)`: the blocks before
        `start` may be shared ones from a prefix cache."""
        began = time.perf_counter()
        self.wait(request_id)
        saved = self.copies.get(request_id)
        try:
            if saved is None or saved.num_tokens < end or any(s.error for s in saved.segments):
                raise CorruptBlobError(f"request {request_id}: no complete saved copy of {end} tokens")
            report = CopyReport(num_tokens=end - start)
            window = _Window(cache, start, end)
            for segment in saved.segments:
                if segment.end <= start or segment.start >= end:
                    continue
                self.store.restore(segment, window, block_ids)
                report.raw_bytes += segment.nbytes_raw
                report.stored_bytes += segment.stored.result()
            report.seconds = time.perf_counter() - began
            return report
        finally:
            self.discard(request_id)

    def load_later(
        self, request_id: str, cache: PagedCache, block_ids: Sequence[int], start: int, end: int
    ) -> Future:
        """`load` on the load thread, in submission order: a future of its `CopyReport`
        (or of its CorruptBlobError). Nothing else may write the blocks, or discard the
        copy, until it is done."""
        return self._loader.submit(lambda: self.load(request_id, cache, block_ids, start, end))

    def discard(self, request_id: str) -> None:
        """Free a request's copy (waiting for a store in flight first)."""
        self.wait(request_id)
        with self._lock:
            saved = self.copies.pop(request_id, None)
            self._unreported.pop(request_id, None)
        for segment in saved.segments if saved else ():
            self.store.free(segment)

    def close(self) -> None:
        self._loader.close()
        self._worker.close()
        for request_id in list(self.copies):
            self.discard(request_id)
        self.store.close()


def _encoding(segment: Segment) -> bool:
    return isinstance(segment.handle, Future) and not segment.handle.done()


class _Window:
    """A paged cache written only in tokens `[lo, hi)`: a segment that starts before `lo`
    (whose first blocks a prefix cache supplied) or ends after `hi` is decoded whole and
    written in part."""

    def __init__(self, cache: PagedCache, lo: int, hi: int) -> None:
        self.cache, self.lo, self.hi = cache, lo, hi

    def scatter(self, kv, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        if kv.ndim < 3 or kv.shape[2] != num_tokens:
            raise CorruptBlobError(f"segment of {num_tokens} tokens decoded to shape {tuple(kv.shape)}")
        lo, hi = max(start, self.lo), min(start + num_tokens, self.hi)
        self.cache.scatter(kv[:, :, lo - start : hi - start], block_ids, lo, hi - lo)

    def scatter_quantized(self, quantized, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        from preempt.kernels.restore_blocks import dequantize_heads_ref

        if quantized.num_tokens != num_tokens:
            raise CorruptBlobError(f"segment of {num_tokens} tokens decoded to {quantized.num_tokens}")
        device = getattr(self.cache, "device", "cpu")  # dequantize where the cache lives
        self.scatter(dequantize_heads_ref(quantized.to(device)), block_ids, start, num_tokens)
