"""The host-memory pool that holds saved KV blobs: one preallocated buffer cut into equal slots.

Owns: the buffer (allocated once, pinned when CUDA is present so device-to-host copies run at
full PCIe speed), the slot free list, and exact byte accounting (`check()` states the invariant).
A slot holds one request's encoded KV blob; `store` copies a blob in, `load` hands back a view
of exactly the stored bytes, `free` gives the slot back.

It must never: allocate host memory after construction (a save that does not fit is refused
with `PreemptionHandlerOOM`, the signal for the scheduler's fallback, SPEC §7), look inside a
blob (that is the codec's job), or know about requests (callers keep the handle).

Thread-safety: one lock guards the free list and counters. The byte copy in `store` runs
outside the lock on a slot already reserved, so a save worker copying 256 MB never blocks the
engine thread's `free`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from preempt.sizes import format_size, parse_size

OOMReason = Literal["pool_full", "slot_too_small"]
Blob = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


class PreemptionHandlerOOM(RuntimeError):
    """The host pool cannot take a KV blob: a load condition, answered by the fallback (SPEC §7).

    `reason` is "pool_full" (every slot in use: raise --preemption-host-mem) or
    "slot_too_small" (one blob is larger than a slot: raise --preemption-slot-size).
    """

    def __init__(self, reason: OOMReason, message: str, *, nbytes: int) -> None:
        super().__init__(message)
        self.reason: OOMReason = reason
        self.nbytes = nbytes


class HostPoolError(RuntimeError):
    """Misuse of the pool (double free, stale handle): a bug, never a load condition."""


@dataclass(frozen=True)
class SlotHandle:
    """Where a stored blob lives. `generation` tells a live handle from a stale one whose slot
    was freed and reused, so a late `load`/`free` fails loudly instead of reading another
    request's KV."""

    slot: int
    nbytes: int
    generation: int


class HostPool:
    """`capacity_bytes // slot_bytes` equal slots in one preallocated host buffer.

    Only whole slots are allocated: the tail `capacity_bytes % slot_bytes` could never hold a
    blob, and pinned memory is too scarce to waste. `pin_memory=None` pins when CUDA is
    available; False never pins (tests, CPU-only runs).
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
                f"--preemption-host-mem ({format_size(capacity_bytes)}) is smaller than one slot "
                f"--preemption-slot-size ({format_size(slot_bytes)}): raise --preemption-host-mem "
                "or lower --preemption-slot-size"
            )
        is_cuda = torch.cuda.is_available()
        if pin_memory and not is_cuda:
            raise ValueError("pin_memory=True needs CUDA; pass None (auto) or False on a CPU-only machine")
        self.capacity_bytes = capacity_bytes
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.is_pinned = bool(is_cuda if pin_memory is None else pin_memory) and allocate
        # (num_slots * slot_bytes,) uint8. Pageable memory is committed on first touch, so an
        # idle pool costs address space, not RSS; pinned memory is committed now. Without
        # `allocate` (the null backend: sizes only, no KV data) there is no buffer at all,
        # so a modelled 64 GB pool needs no 64 GB mapping; `store`/`load` then refuse.
        self._buffer = torch.empty(
            self.num_slots * slot_bytes if allocate else 0, dtype=torch.uint8, pin_memory=self.is_pinned
        )
        self._array = self._buffer.numpy()  # same memory; numpy gives cheap memoryviews for load()
        self.has_data = allocate
        self._lock = threading.Lock()
        # LIFO: the most recently freed slot is reused first, so pageable memory already touched
        # is reused and RSS stays near the peak working set instead of the whole capacity.
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._nbytes: list[int | None] = [None] * self.num_slots  # None = free; set while reserved
        self._generation = [0] * self.num_slots
        self._bytes_used = 0
        self._peak_bytes_used = 0

    # ---- accounting -------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used_slots(self) -> int:
        with self._lock:
            return self.num_slots - len(self._free)

    @property
    def bytes_used(self) -> int:
        """Sum of the stored blobs' lengths (not whole slots)."""
        with self._lock:
            return self._bytes_used

    @property
    def peak_bytes_used(self) -> int:
        with self._lock:
            return self._peak_bytes_used

    @property
    def allocated_bytes(self) -> int:
        return self._buffer.numel()

    def can_store(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits now. Advisory: another thread may take the last slot
        before the caller stores, so `store` can still raise."""
        with self._lock:
            return nbytes <= self.slot_bytes and bool(self._free)

    def check(self) -> None:
        """Assert the accounting invariant: every slot is free xor holds one blob <= a slot, and
        bytes_used is the sum of the held lengths."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a slot is on the free list twice"
            held = [n for n in self._nbytes if n is not None]
            assert len(free) + len(held) == self.num_slots, "free + used != num_slots"
            for slot in range(self.num_slots):
                assert (slot in free) == (self._nbytes[slot] is None), f"slot {slot} both free and used"
            assert all(0 <= n <= self.slot_bytes for n in held), "a blob is larger than its slot"
            assert self._bytes_used == sum(held), f"bytes_used {self._bytes_used} != {sum(held)}"
            assert self._bytes_used <= self._peak_bytes_used, "peak below current use"

    # ---- store / load / free ----------------------------------------------------------------

    def store(self, blob: Blob | list[Blob] | tuple[Blob, ...], into: SlotHandle | None = None) -> SlotHandle:
        """Copy `blob` into a free slot. Raises PreemptionHandlerOOM (and holds nothing) when the
        blob is larger than a slot (checked first: no amount of waiting fixes it) or no slot is
        free.

        `blob` may be a list of parts (`Codec.encode_parts`), stored back to back as one blob:
        the raw codec's payload then goes from the KV tensor into the slot in one copy, with the
        GIL released, instead of being joined into a bytes object first. A uint8 tensor may live
        on any device: a CUDA tensor is copied device-to-host straight into the (pinned) slot.

        `into`: a slot claimed earlier with `reserve(upper bound)` (a save whose failure must
        be known before its blob is encoded); the blob goes there and the slot's byte count
        shrinks to the blob's size. On any failure that slot is released.
        """
        if not self.has_data:
            raise RuntimeError("this HostPool was made with allocate=False (sizes only): use reserve()")
        parts = [_as_bytes_source(part) for part in (blob if isinstance(blob, (list, tuple)) else [blob])]
        sizes = [part.numel() if isinstance(part, torch.Tensor) else part.nbytes for part in parts]
        nbytes = sum(sizes)
        handle = self.reserve(nbytes) if into is None else self._shrink(into, nbytes)
        slot = handle.slot
        offset = slot * self.slot_bytes
        try:
            for part, size in zip(parts, sizes, strict=True):
                if isinstance(part, torch.Tensor):
                    self._buffer[offset : offset + size].copy_(part)
                else:
                    self._array[offset : offset + size] = part  # numpy copies with the GIL released
                offset += size
        except BaseException:
            with self._lock:  # the reservation must not leak when the copy fails
                self._release(slot, nbytes)
            raise
        return handle

    def reserve(self, nbytes: int) -> SlotHandle:
        """Claim a slot for `nbytes` without copying anything: `store` uses it, and so does
        the `null` backend, which models KV sizes but has no KV data. Same errors as
        `store`; accounting is identical."""
        if nbytes > self.slot_bytes:
            raise PreemptionHandlerOOM(
                "slot_too_small",
                f"KV blob does not fit one host slot: raise --preemption-slot-size "
                f"(blob {format_size(nbytes)} > slot {format_size(self.slot_bytes)})",
                nbytes=nbytes,
            )
        with self._lock:
            if not self._free:
                raise PreemptionHandlerOOM(
                    "pool_full",
                    f"host KV pool is full, cannot save {format_size(nbytes)}: raise --preemption-host-mem "
                    f"(now {format_size(self.capacity_bytes)}, {self.num_slots} of {self.num_slots} "
                    "slots in use)",
                    nbytes=nbytes,
                )
            slot = self._free.pop()
            self._nbytes[slot] = nbytes
            self._generation[slot] += 1
            self._bytes_used += nbytes
            self._peak_bytes_used = max(self._peak_bytes_used, self._bytes_used)
            return SlotHandle(slot=slot, nbytes=nbytes, generation=self._generation[slot])

    def load(self, handle: SlotHandle) -> memoryview:
        """A read-only view of exactly the stored bytes, no copy. Valid until `free(handle)`:
        consume (decode) it before freeing the slot."""
        with self._lock:
            self._validate(handle, "load")
        start = handle.slot * self.slot_bytes
        return memoryview(self._array[start : start + handle.nbytes]).toreadonly()

    def load_tensor(self, handle: SlotHandle) -> torch.Tensor:
        """The stored bytes as a (nbytes,) uint8 tensor view of the (pinned) buffer, no copy: the
        source for a non_blocking host-to-device copy. Same lifetime rule as `load`."""
        with self._lock:
            self._validate(handle, "load")
        start = handle.slot * self.slot_bytes
        return self._buffer[start : start + handle.nbytes]

    def free(self, handle: SlotHandle) -> None:
        """Give the slot back. Freeing twice, or freeing a stale handle, raises HostPoolError."""
        with self._lock:
            self._validate(handle, "free")
            self._release(handle.slot, handle.nbytes)

    def _shrink(self, reservation: SlotHandle, nbytes: int) -> SlotHandle:
        """The reserved slot, now recorded as holding `nbytes` (<= its reservation)."""
        with self._lock:
            self._validate(reservation, "store into")
            if nbytes > reservation.nbytes:
                self._release(reservation.slot, reservation.nbytes)
                raise PreemptionHandlerOOM(
                    "slot_too_small",
                    f"KV blob of {format_size(nbytes)} exceeds its reservation of "
                    f"{format_size(reservation.nbytes)}",
                    nbytes=nbytes,
                )
            self._nbytes[reservation.slot] = nbytes
            self._bytes_used -= reservation.nbytes - nbytes
            return SlotHandle(slot=reservation.slot, nbytes=nbytes, generation=reservation.generation)

    # ---- internals (call with the lock held) ------------------------------------------------

    def _validate(self, handle: SlotHandle, action: str) -> None:
        if not 0 <= handle.slot < self.num_slots:
            raise HostPoolError(f"cannot {action} {handle}: no such slot (pool has {self.num_slots})")
        if self._nbytes[handle.slot] is None or self._generation[handle.slot] != handle.generation:
            raise HostPoolError(f"cannot {action} {handle}: slot already freed (double free or stale handle)")
        if self._nbytes[handle.slot] != handle.nbytes:
            raise HostPoolError(f"cannot {action} {handle}: slot holds {self._nbytes[handle.slot]} bytes")

    def _release(self, slot: int, nbytes: int) -> None:
        self._nbytes[slot] = None
        self._bytes_used -= nbytes
        self._free.append(slot)


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
