"""Moves preempted requests' KV: device blocks -> codec -> host slot, and back.

Owns: the save/restore data path (gather blocks into logical order, encode, store into
the host pool; load, decode, scatter into newly allocated blocks), the checksum fallback
(a blob that fails to decode is dropped and the request recomputed, counted), and the
timing of each move. It decides nothing: the scheduler says who is saved and restored.

Timing. On the virtual clock, a save is modelled as the target's KV bytes crossing PCIe
on a device-to-host copy timeline (the blocks are busy until that copy ends), then the
host-side encode at the codec's calibrated throughput; a restore as decode plus the
host-to-device copy. These run concurrently with compute; the engine stalls compute only
when a step needs blocks still being copied out, or a restored request (vLLM V0 swap-in
semantics). Data still moves for real on the `tiny` backend (bit-exact round trips are
tested), but instantly in virtual time. On the wall clock, the gather runs on the engine
thread and encode + store on a worker thread, so compression overlaps the next steps.

Sizes. Host-pool bytes are the bytes of the backend that stores them: the tiny model's
real KV, or, with the `null` backend (no KV data), the target's modelled KV divided by
the codec's assumed ratio (`preemption.modelled_ratio`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from preempt.block_pool import blocks_needed
from preempt.codec import CorruptBlobError, make_codec
from preempt.config import EngineConfig
from preempt.cost_model import CostModel
from preempt.host_pool import HostPool, PreemptionHandlerOOM, SlotHandle
from preempt.kv_cache import KVCache
from preempt.request import Request
from preempt.scheduler import KVMover, PreemptionRecord


@dataclass
class _Saved:
    handle: SlotHandle | Future | None  # a Future while the worker is still encoding
    codec: str
    num_tokens: int
    ready_at_s: float  # virtual: when the host copy is complete


class Saver(KVMover):
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None, cost_model: CostModel, block_size: int
    ):
        p = config.preemption
        self.config = p
        self.host_pool = HostPool(p.host_mem, p.slot_size)
        self.codecs = {
            "raw": make_codec("raw"),
            "zstd": make_codec("zstd", level=p.zstd_level, threads=p.zstd_threads, shuffle=p.zstd_shuffle),
        }
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.block_size = block_size
        self.is_virtual = config.clock.kind == "virtual"
        self._worker = None if self.is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-saver")
        self._num_pending = 0  # saves queued on the worker, each promised a slot
        self._pending_lock = threading.Lock()
        self._saved: dict[int, _Saved] = {}  # id(request) -> its host copy
        self._d2h_free_at = 0.0
        self._h2d_free_at = 0.0
        self.save_copy_end_s = 0.0  # virtual: when the latest save's copy-out ends
        self.restore_end_s = 0.0  # virtual: when the latest restore's copy-in ends
        self.bytes_raw = 0
        self.bytes_stored = 0
        self.engine_thread_s = 0.0  # wall clock: time the engine thread spent saving/restoring

    # ----------------------------------------------------------------- save
    def save(self, request: Request, codec: str, now: float, record: PreemptionRecord) -> str | None:
        started = time.perf_counter()
        num_tokens = request.num_computed_tokens
        if self.kv_cache is None:
            handle_or_failure = self._reserve_modelled(num_tokens, codec, record)
        else:
            kv = self._gather(request.block_ids, num_tokens)  # (L, 2, n, bs, H, D), a copy
            record.bytes_raw = kv.numel() * kv.element_size()
            handle_or_failure = (
                self._store_async(kv, codec, record) if self._worker else self._store(kv, codec, record)
            )
        if isinstance(handle_or_failure, str):
            return handle_or_failure
        if self.is_virtual:
            ready = self._model_save_time(num_tokens, codec, now)
            record.save_s = ready - now
        else:
            ready = now
            record.save_s = time.perf_counter() - started  # the engine thread's share
            self.engine_thread_s += record.save_s
        self._saved[id(request)] = _Saved(handle_or_failure, codec, num_tokens, ready)
        self.bytes_raw += record.bytes_raw
        if not isinstance(handle_or_failure, Future):  # the worker counts its own when done
            self.bytes_stored += record.bytes_stored
        return None

    def _gather(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The request's blocks in logical order, (L, 2, n, bs, H, D), in one copy. Whole
        blocks: copying block-sized runs is faster than token-sized ones, and the last
        block's unused slots (under one block per request) ride along."""
        return self.kv_cache.read_blocks(block_ids[: blocks_needed(num_tokens, self.block_size)])

    def _store(self, kv: torch.Tensor, codec: str, record: PreemptionRecord) -> SlotHandle | str:
        parts = self.codecs[codec].encode_parts(kv)
        try:
            handle = self.host_pool.store(parts)
        except PreemptionHandlerOOM as err:
            return err.reason
        record.bytes_stored = handle.nbytes
        return handle

    def _store_async(self, kv: torch.Tensor, codec: str, record: PreemptionRecord) -> Future | str:
        # Failures must be known now (the scheduler decides on them), so check before
        # queueing: the raw size bounds the blob (plus the small header/zstd framing),
        # and every queued save holds the promise of one free slot.
        if record.bytes_raw > self.host_pool.slot_bytes:
            return "slot_too_small"
        with self._pending_lock:
            if self.host_pool.num_free_slots - self._num_pending <= 0:
                return "pool_full"
            self._num_pending += 1

        def work() -> SlotHandle | None:
            try:
                result = self._store(kv, codec, record)
            finally:
                with self._pending_lock:
                    self._num_pending -= 1
                    self.bytes_stored += record.bytes_stored
            return result if isinstance(result, SlotHandle) else None  # lost: restore recomputes

        return self._worker.submit(work)

    def _reserve_modelled(self, num_tokens: int, codec: str, record: PreemptionRecord) -> SlotHandle | str:
        record.bytes_raw = num_tokens * self.cost_model.target.kv_bytes_per_token
        try:
            handle = self.host_pool.reserve(int(record.bytes_raw / self.config.modelled_ratio[codec]))
        except PreemptionHandlerOOM as err:
            return err.reason
        record.bytes_stored = handle.nbytes
        return handle

    def _model_save_time(self, num_tokens: int, codec: str, now: float) -> float:
        nbytes = num_tokens * self.cost_model.target.kv_bytes_per_token  # the deployment's KV
        start = max(now, self._d2h_free_at)
        self._d2h_free_at = start + self.cost_model.pcie_time_s(nbytes)
        self.save_copy_end_s = max(self.save_copy_end_s, self._d2h_free_at)
        return self._d2h_free_at + _codec_time_s(nbytes, self.config.codec_encode_mb_s[codec])

    # ----------------------------------------------------------------- restore
    def restore(self, request: Request, now: float, record: PreemptionRecord) -> bool:
        started = time.perf_counter()
        saved = self._saved.pop(id(request))
        handle = saved.handle.result() if isinstance(saved.handle, Future) else saved.handle
        ok = handle is not None and (self.kv_cache is None or self._load_into(request, handle, saved))
        if handle is not None:
            self.host_pool.free(handle)
        record.restored = ok
        if self.is_virtual:
            nbytes = saved.num_tokens * self.cost_model.target.kv_bytes_per_token
            start = max(now, saved.ready_at_s, self._h2d_free_at)
            end = start + _codec_time_s(nbytes, self.config.codec_decode_mb_s[saved.codec])
            end += self.cost_model.pcie_time_s(nbytes)
            self._h2d_free_at = end
            self.restore_end_s = max(self.restore_end_s, end)
            record.restore_s = end - now
        else:
            record.restore_s = time.perf_counter() - started
            self.engine_thread_s += record.restore_s
        return ok

    def _load_into(self, request: Request, handle: SlotHandle, saved: _Saved) -> bool:
        kv_cache = self.kv_cache
        try:
            kv = self.codecs[saved.codec].decode(self.host_pool.load(handle))  # (L, 2, n, bs, H, D)
        except CorruptBlobError:
            return False
        num_blocks = blocks_needed(saved.num_tokens, self.block_size)
        expected = (
            kv_cache.num_layers,
            2,
            num_blocks,
            self.block_size,
            kv_cache.num_kv_heads,
            kv_cache.head_dim,
        )
        if tuple(kv.shape) != expected or kv.dtype != kv_cache.dtype:
            return False  # a valid blob, but not this request's KV
        kv_cache.write_blocks(request.block_ids[:num_blocks], kv)
        return True

    def discard(self, request: Request) -> None:
        saved = self._saved.pop(id(request), None)
        if saved is None:
            return
        handle = saved.handle.result() if isinstance(saved.handle, Future) else saved.handle
        if handle is not None:
            self.host_pool.free(handle)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _codec_time_s(nbytes: float, mb_per_s: float) -> float:
    return nbytes / (mb_per_s * 1e6) if mb_per_s > 0 else 0.0
