"""The host-memory pool that holds saved KV blobs: one preallocated buffer, each blob in its own size.

Owns: the buffer (allocated once, pinned when CUDA is present so device-to-host copies run at
full PCIe speed), an arena allocator over it (first-fit free extents, coalesced on free, each
extent rounded up to `ALIGN` bytes), and exact byte accounting (`check()` states the
invariant). A 0.2 MB save takes 0.2 MB, not a whole `slot_bytes`: `slot_bytes`
(`--preemption-slot-size`) is only the largest blob the pool accepts. `store` copies a blob
in, `load` hands back a view of exactly the stored bytes, `free` gives its extent back,
`close` frees the whole buffer (the engine's `close`; the pool is unusable after it).

It must never: allocate host memory after construction (a save that does not fit is refused
with `PreemptionHandlerOOM`, the signal for the scheduler's fallback, docs/design.md §7), look inside a
blob (that is the codec's job), or know about requests (callers keep the handle).

Thread-safety: one lock guards the extents and counters. The byte copy in `store` runs
outside the lock on an extent already reserved, so a save worker copying 256 MB never blocks
the engine thread's `free`.
"""

from __future__ import annotations

import bisect
import copy
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from preempt.core.sizes import format_size, parse_size

OOMReason = Literal["pool_full", "blob_too_large"]
Blob = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


class PreemptionHandlerOOM(RuntimeError):
    """The host pool cannot take a KV blob: a load condition, answered by the fallback (docs/design.md §7).

    `reason` is "pool_full" (no free extent large enough: raise --preemption-host-mem) or
    "blob_too_large" (the blob is larger than --preemption-slot-size allows).
    """

    def __init__(self, reason: OOMReason, message: str, *, nbytes: int) -> None:
        super().__init__(message)
        self.reason: OOMReason = reason
        self.nbytes = nbytes


class HostPoolError(RuntimeError):
    """Misuse of the pool (double free, stale handle): a bug, never a load condition."""


ALIGN = 64  # extents start on cache lines (and DMA-friendly offsets in the pinned buffer)


def _extent(nbytes: int) -> int:
    """Arena bytes a blob of `nbytes` takes: rounded up to ALIGN, at least ALIGN (an empty
    blob still needs an address of its own)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


@dataclass(frozen=True)
class BlobHandle:
    """Where a stored blob lives: its extent [offset, offset + extent) in the arena, of which
    the first `nbytes` are the blob. `generation` tells a live handle from a stale one whose
    extent was freed and reused, so a late `load`/`free` fails loudly instead of reading
    another request's KV."""

    offset: int
    nbytes: int
    extent: int
    generation: int


class HostPool:
    """One preallocated host buffer of `capacity_bytes` (rounded down to ALIGN), holding blobs
    of up to `slot_bytes` each, every blob in its own (aligned) size.

    `num_slots` / `num_free_slots` count *largest* blobs (`slot_bytes`): how many the empty pool
    holds, and how many still fit in the free extents now. `num_used_slots` is the number of
    blobs held. `pin_memory=None` pins when CUDA is available; False never pins (tests,
    CPU-only runs).
    """

    def __init__(
        self,
        capacity_bytes: int | str,
        slot_bytes: int | str,
        pin_memory: bool | None = None,
        allocate: bool = True,
    ) -> None:
        capacity_bytes = parse_size(capacity_bytes)
        slot_bytes = parse_size(slot_bytes)
        if slot_bytes <= 0:
            raise ValueError(f"--preemption-slot-size must be > 0, got {slot_bytes}")
        if capacity_bytes < slot_bytes:
            raise ValueError(
                f"--preemption-host-mem ({format_size(capacity_bytes)}) is smaller than the largest "
                f"blob --preemption-slot-size ({format_size(slot_bytes)}): raise --preemption-host-mem "
                "or lower --preemption-slot-size"
            )
        is_cuda = torch.cuda.is_available()
        if pin_memory and not is_cuda:
            raise ValueError("pin_memory=True needs CUDA; pass None (auto) or False on a CPU-only machine")
        self.capacity_bytes = capacity_bytes // ALIGN * ALIGN
        self.slot_bytes = slot_bytes
        self._slot_extent = _extent(slot_bytes)
        self.num_slots = self.capacity_bytes // self._slot_extent
        self.is_pinned = bool(is_cuda if pin_memory is None else pin_memory) and allocate
        # (capacity_bytes,) uint8. Pageable memory is committed on first touch, so an idle pool
        # costs address space, not RSS; pinned memory is committed now. Without `allocate` (the
        # null backend: sizes only, no KV data) there is no buffer at all, so a modelled 64 GB
        # pool needs no 64 GB mapping; `store`/`load` then refuse.
        self._buffer = torch.empty(
            self.capacity_bytes if allocate else 0, dtype=torch.uint8, pin_memory=self.is_pinned
        )
        self._array = self._buffer.numpy()  # same memory; numpy gives cheap memoryviews for load()
        self.has_data = allocate
        self.closed = False
        self._lock = threading.Lock()
        # Free extents as (offset, length), sorted by offset, never adjacent (coalesced).
        # First fit from the lowest offset: memory already touched is reused first, so RSS
        # stays near the peak working set instead of the whole capacity.
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)] if self.capacity_bytes else []
        self._live: dict[int, tuple[int, int, int]] = {}  # offset -> (nbytes, extent, generation)
        self._generation = 0
        self._bytes_used = 0  # sum of the held blobs' lengths
        self._bytes_reserved = 0  # sum of their extents
        self._peak_bytes_used = 0

    # ---- accounting -------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        """Largest blobs (`slot_bytes`) that fit in the free extents now."""
        with self._lock:
            return sum(length // self._slot_extent for _, length in self._free)

    @property
    def num_used_slots(self) -> int:
        """Blobs held (of any size)."""
        with self._lock:
            return len(self._live)

    @property
    def bytes_used(self) -> int:
        """Sum of the stored blobs' lengths."""
        with self._lock:
            return self._bytes_used

    @property
    def bytes_reserved(self) -> int:
        """Arena bytes taken by the held blobs (their lengths rounded up to ALIGN)."""
        with self._lock:
            return self._bytes_reserved

    @property
    def bytes_free(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._bytes_reserved

    @property
    def largest_free_extent(self) -> int:
        with self._lock:
            return max((length for _, length in self._free), default=0)

    @property
    def peak_bytes_used(self) -> int:
        with self._lock:
            return self._peak_bytes_used

    @property
    def allocated_bytes(self) -> int:
        return self._buffer.numel()

    def can_store(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits now. Advisory: another thread may take the space
        before the caller stores, so `store` can still raise."""
        extent = _extent(nbytes)
        with self._lock:
            return nbytes <= self.slot_bytes and any(length >= extent for _, length in self._free)

    def check(self) -> None:
        """Assert the accounting invariant: free extents and held extents are disjoint, sorted,
        coalesced and together tile [0, capacity) exactly; each blob fits its extent and is at
        most `slot_bytes`; bytes_used and bytes_reserved are the sums of the held lengths and
        extents."""
        with self._lock:
            pieces = [(o, n, "free") for o, n in self._free]
            pieces += [(o, extent, "held") for o, (_, extent, _) in self._live.items()]
            pieces.sort()
            position = 0
            for offset, length, kind in pieces:
                assert offset == position, f"gap or overlap at {position} (next {kind} extent at {offset})"
                assert length > 0 and offset % ALIGN == 0, f"bad {kind} extent ({offset}, {length})"
                position += length
            assert position == self.capacity_bytes, f"extents cover {position} of {self.capacity_bytes}"
            for (o1, n1), (o2, _) in zip(self._free, self._free[1:], strict=False):
                assert o1 + n1 < o2, f"free extents at {o1} and {o2} not coalesced"
            held = list(self._live.values())
            assert all(0 <= n <= min(e, self.slot_bytes) for n, e, _ in held), "a blob exceeds its extent"
            assert self._bytes_used == sum(n for n, _, _ in held), "bytes_used != sum of blob lengths"
            assert self._bytes_reserved == sum(e for _, e, _ in held), "bytes_reserved != sum of extents"
            assert self._bytes_used <= self._peak_bytes_used, "peak below current use"

    # ---- store / load / free ----------------------------------------------------------------

    def store(self, blob: Blob | list[Blob] | tuple[Blob, ...], into: BlobHandle | None = None) -> BlobHandle:
        """Copy `blob` into the pool. Raises PreemptionHandlerOOM (and holds nothing) when the
        blob is larger than `slot_bytes` (checked first: no amount of waiting fixes it) or no
        free extent is large enough.

        `blob` may be a list of parts (`Codec.encode_parts`), stored back to back as one blob:
        the raw codec's payload then goes from the KV tensor into the pool in one copy, with the
        GIL released, instead of being joined into a bytes object first. A uint8 tensor may live
        on any device: a CUDA tensor is copied device-to-host straight into the (pinned) buffer.

        `into`: an extent claimed earlier with `reserve(upper bound)` (a save whose failure must
        be known before its blob is encoded); the blob goes there and the extent shrinks to the
        blob's size, its tail going back to the free list. On any failure it is released.
        """
        if self.closed:
            raise HostPoolError("the host pool is closed (Engine.close() freed its buffer)")
        if not self.has_data:
            raise RuntimeError("this HostPool was made with allocate=False (sizes only): use reserve()")
        parts = [_as_bytes_source(part) for part in (blob if isinstance(blob, (list, tuple)) else [blob])]
        sizes = [part.numel() if isinstance(part, torch.Tensor) else part.nbytes for part in parts]
        nbytes = sum(sizes)
        handle = self.reserve(nbytes) if into is None else self._shrink(into, nbytes)
        offset = handle.offset
        try:
            for part, size in zip(parts, sizes, strict=True):
                if isinstance(part, torch.Tensor):
                    self._buffer[offset : offset + size].copy_(part)
                else:
                    self._array[offset : offset + size] = part  # numpy copies with the GIL released
                offset += size
        except BaseException:
            with self._lock:  # the reservation must not leak when the copy fails
                self._release(handle.offset)
            raise
        return handle

    def reserve(self, nbytes: int) -> BlobHandle:
        """Claim an extent for `nbytes` without copying anything: `store` uses it, and so does
        the `null` backend, which models KV sizes but has no KV data. Same errors as
        `store`; accounting is identical."""
        if nbytes > self.slot_bytes:
            raise PreemptionHandlerOOM(
                "blob_too_large",
                f"KV blob larger than the largest allowed: raise --preemption-slot-size "
                f"(blob {format_size(nbytes)} > {format_size(self.slot_bytes)})",
                nbytes=nbytes,
            )
        if self.closed:
            raise HostPoolError("the host pool is closed (Engine.close() freed its buffer)")
        extent = _extent(nbytes)
        with self._lock:
            index = next((i for i, (_, length) in enumerate(self._free) if length >= extent), None)
            if index is None:
                largest = max((length for _, length in self._free), default=0)
                raise PreemptionHandlerOOM(
                    "pool_full",
                    f"host KV pool is full, cannot save {format_size(nbytes)}: raise --preemption-host-mem "
                    f"(now {format_size(self.capacity_bytes)}: {format_size(self._bytes_used)} in "
                    f"{len(self._live)} blobs, largest free extent {format_size(largest)})",
                    nbytes=nbytes,
                )
            offset, length = self._free[index]
            if length == extent:
                del self._free[index]
            else:
                self._free[index] = (offset + extent, length - extent)
            self._generation += 1
            self._live[offset] = (nbytes, extent, self._generation)
            self._bytes_used += nbytes
            self._bytes_reserved += extent
            self._peak_bytes_used = max(self._peak_bytes_used, self._bytes_used)
            return BlobHandle(offset=offset, nbytes=nbytes, extent=extent, generation=self._generation)

    def load(self, handle: BlobHandle) -> memoryview:
        """A read-only view of exactly the stored bytes, no copy. Valid until `free(handle)`:
        consume (decode) it before freeing."""
        with self._lock:
            self._validate(handle, "load")
        return memoryview(self._array[handle.offset : handle.offset + handle.nbytes]).toreadonly()

    def load_tensor(self, handle: BlobHandle) -> torch.Tensor:
        """The stored bytes as a (nbytes,) uint8 tensor view of the (pinned) buffer, no copy: the
        source for a non_blocking host-to-device copy. Same lifetime rule as `load`."""
        with self._lock:
            self._validate(handle, "load")
        return self._buffer[handle.offset : handle.offset + handle.nbytes]

    def free(self, handle: BlobHandle) -> None:
        """Give the extent back. Freeing twice, or freeing a stale handle, raises HostPoolError."""
        with self._lock:
            self._validate(handle, "free")
            self._release(handle.offset)

    def __deepcopy__(self, memo: dict[int, object]) -> HostPool:
        """The arena's bookkeeping (free extents, live blobs, byte counts) copied; no byte
        buffer (`has_data` False): a copy models sizes and slots only (an engine fork's)."""
        copied = object.__new__(HostPool)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name not in ("_buffer", "_array", "_lock"):
                setattr(copied, name, copy.deepcopy(value, memo))
        copied._buffer = torch.empty(0, dtype=torch.uint8)
        copied._array = copied._buffer.numpy()
        copied.has_data = False
        copied.is_pinned = False
        copied._lock = threading.Lock()
        return copied

    def close(self) -> None:
        """Free the buffer (the whole capacity's mapping). Idempotent. The counters stay
        readable; `store`, `reserve` and `load` raise HostPoolError afterwards, `free` only
        keeps the books. A view from `load` still held keeps its bytes alive."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            was_pinned = self.is_pinned
            self._buffer = torch.empty(0, dtype=torch.uint8)
            self._array = self._buffer.numpy()
            self.is_pinned = False
        if was_pinned:
            # A freed pinned buffer goes back to torch's host caching allocator, not to the
            # OS: empty that cache (only its unused blocks) so the memory really is returned.
            empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            empty_host_cache = empty_host_cache or getattr(torch._C, "_host_emptyCache", None)
            if empty_host_cache is not None:
                empty_host_cache()

    def _shrink(self, reservation: BlobHandle, nbytes: int) -> BlobHandle:
        """The reserved extent, now holding `nbytes` (<= its reservation); the unused tail
        (whole ALIGN units) goes back to the free list."""
        with self._lock:
            self._validate(reservation, "store into")
            if nbytes > reservation.nbytes:
                self._release(reservation.offset)
                raise PreemptionHandlerOOM(
                    "blob_too_large",
                    f"KV blob of {format_size(nbytes)} exceeds its reservation of "
                    f"{format_size(reservation.nbytes)}",
                    nbytes=nbytes,
                )
            extent = _extent(nbytes)
            if extent < reservation.extent:
                self._insert_free(reservation.offset + extent, reservation.extent - extent)
            self._live[reservation.offset] = (nbytes, extent, reservation.generation)
            self._bytes_used -= reservation.nbytes - nbytes
            self._bytes_reserved -= reservation.extent - extent
            return BlobHandle(reservation.offset, nbytes, extent, reservation.generation)

    # ---- internals (call with the lock held) ------------------------------------------------

    def _validate(self, handle: BlobHandle, action: str) -> None:
        if self.closed and action != "free":
            raise HostPoolError(f"cannot {action} {handle}: the host pool is closed")
        held = self._live.get(handle.offset)
        if held is None or held[2] != handle.generation:
            raise HostPoolError(f"cannot {action} {handle}: already freed (double free or stale handle)")
        if held[0] != handle.nbytes:
            raise HostPoolError(f"cannot {action} {handle}: the pool holds {held[0]} bytes there")

    def _release(self, offset: int) -> None:
        nbytes, extent, _ = self._live.pop(offset)
        self._bytes_used -= nbytes
        self._bytes_reserved -= extent
        self._insert_free(offset, extent)

    def _insert_free(self, offset: int, length: int) -> None:
        """Add a free extent, merged with its neighbours."""
        index = bisect.bisect_left(self._free, (offset, 0))
        if index < len(self._free) and offset + length == self._free[index][0]:
            length += self._free.pop(index)[1]  # merge the next one
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:
            prev_offset, prev_length = self._free[index - 1]
            self._free[index - 1] = (prev_offset, prev_length + length)  # into the previous one
        else:
            self._free.insert(index, (offset, length))


def _as_bytes_source(blob: Blob) -> np.ndarray | torch.Tensor:
    """A flat uint8 view of `blob` without copying: a tensor stays a tensor (so a CUDA source
    is copied by torch), anything with the buffer protocol becomes a numpy array."""
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8:
            raise TypeError(f"store() takes a uint8 tensor, got {blob.dtype}; view it as torch.uint8 first")
        return blob.reshape(-1)
    if isinstance(blob, np.ndarray):
        if blob.dtype != np.uint8:
            raise TypeError(f"store() takes a uint8 array, got {blob.dtype}; view it as np.uint8 first")
        return blob.reshape(-1)
    try:
        return np.frombuffer(blob, dtype=np.uint8)
    except TypeError as exc:
        raise TypeError(
            f"store() takes bytes, memoryview, a uint8 array or tensor, got {type(blob).__name__}"
        ) from exc
