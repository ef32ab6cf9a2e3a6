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

Mixed precision (`swap_mixed`, SPEC §9). The save quantizes on the device, fused with
the block gather (`kernels.quantize_heads`: Triton on CUDA, its torch reference on CPU),
so only the packed bytes cross PCIe; the restore dequantizes into the new blocks
(`kernels.restore_blocks`), marks the plan's dropped heads on the request (attention
masks them for the rest of its life) and reports `warmup_tokens` for the scheduler to
recompute at full precision. Virtual time: one HBM pass (raw in, packed out), PCIe of the
packed bytes (the target's KV times the plan's size ratio at 16 bits), host zstd only with
`mixed_zstd`.

Sizes. Host-pool bytes are the bytes of the backend that stores them: the tiny model's
real KV, or, with the `null` backend (no KV data), the target's modelled KV divided by
the codec's assumed ratio (`preemption.modelled_ratio`; for `mixed`, the plan's ratio).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from preempt.block_pool import blocks_needed
from preempt.codec import CorruptBlobError, MixedCodec, make_codec
from preempt.config import EngineConfig, PreemptionConfig
from preempt.cost_model import CostModel
from preempt.host_pool import HostPool, PreemptionHandlerOOM, SlotHandle
from preempt.kv_cache import KVCache
from preempt.request import Request
from preempt.scheduler import KVMover, PreemptionRecord


def head_plan_for(config: PreemptionConfig, num_layers: int, num_kv_heads: int, seed: int):
    """The `swap_mixed` head plan of a model with this many layers and KV heads."""
    from kernels.plan import HeadPlan

    name = config.head_plan
    if name == "fp16":
        return HeadPlan.all_fp16(num_layers, num_kv_heads)
    if name == "fp8":
        return HeadPlan.all_fp8(num_layers, num_kv_heads)
    if name == "random":
        return HeadPlan.random(
            num_layers,
            num_kv_heads,
            fp8_share=config.head_plan_fp8_share,
            drop_share=config.head_plan_drop_share,
            seed=seed,
        )
    return HeadPlan.load(name)


def plan_size_ratio(plan) -> float:
    """Stored bytes of KV under `plan` over 16-bit KV: what the plan saves on a 16-bit
    deployment (per-request scales excluded: they do not grow with tokens)."""
    total = plan.num_layers * plan.num_kv_heads
    return (2 * plan.num_fp16 + plan.num_fp8) / (2 * total)


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
        self.plan = None  # swap_mixed: the head plan, shaped like the KV this saver moves
        self.mixed_ratio = 1.0  # the plan's stored bytes over 16-bit KV (virtual timing)
        if p.mode == "swap_mixed":
            target = cost_model.target
            shape = (
                (kv_cache.num_layers, kv_cache.num_kv_heads)
                if kv_cache is not None
                else (target.num_layers, target.num_kv_heads)
            )
            try:
                self.plan = head_plan_for(p, *shape, seed=config.seed)
                if kv_cache is not None:
                    self.plan.check_shape(*shape)
            except ValueError as err:
                raise ValueError(f"config key 'preemption.head_plan': {err}") from None
            self.mixed_ratio = plan_size_ratio(self.plan)
            self.codecs["mixed"] = MixedCodec(self.plan, zstd=p.mixed_zstd, level=p.zstd_level)
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
            make_parts, bound = self._prepare(request.block_ids, num_tokens, codec, record)
            handle_or_failure = (
                self._store_async(make_parts, bound, record)
                if self._worker
                else self._store(make_parts, record)
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

    def _prepare(
        self, block_ids: list[int], num_tokens: int, codec: str, record: PreemptionRecord
    ) -> tuple[Callable[[], list], int]:
        """Copy the request's KV out of its blocks now (they are freed right after) and
        return (the encoder of the blob's parts, an upper bound of the blob's size).

        Whole blocks for the lossless codecs: copying block-sized runs is faster than
        token-sized ones, and the last block's unused slots ride along. `mixed` gathers and
        quantizes in one pass over exactly `num_tokens` tokens."""
        num_blocks = blocks_needed(num_tokens, self.block_size)
        record.bytes_raw = num_blocks * self.block_size * self.kv_cache.bytes_per_token
        if codec == "mixed":
            from kernels.quantize_heads import gather_quantize_heads

            quantized = gather_quantize_heads(self.kv_cache.kv, block_ids[:num_blocks], num_tokens, self.plan)
            quantized = quantized.to("cpu")
            mixed = self.codecs["mixed"]
            return (lambda: mixed.encode_quantized(quantized)), quantized.nbytes + _HEADER_SLACK
        kv = self.kv_cache.read_blocks(block_ids[:num_blocks])  # (L, 2, n, bs, H, D), a copy
        return (lambda: self.codecs[codec].encode_parts(kv)), record.bytes_raw + _HEADER_SLACK

    def _store(self, make_parts: Callable[[], list], record: PreemptionRecord) -> SlotHandle | str:
        try:
            handle = self.host_pool.store(make_parts())
        except PreemptionHandlerOOM as err:
            return err.reason
        record.bytes_stored = handle.nbytes
        return handle

    def _store_async(
        self, make_parts: Callable[[], list], bound: int, record: PreemptionRecord
    ) -> Future | str:
        # Failures must be known now (the scheduler decides on them), so check before
        # queueing: `bound` bounds the blob (the packed or raw size plus header/zstd
        # framing), and every queued save holds the promise of one free slot.
        if bound > self.host_pool.slot_bytes:
            return "slot_too_small"
        with self._pending_lock:
            if self.host_pool.num_free_slots - self._num_pending <= 0:
                return "pool_full"
            self._num_pending += 1

        def work() -> SlotHandle | None:
            try:
                result = self._store(make_parts, record)
            finally:
                with self._pending_lock:
                    self._num_pending -= 1
                    self.bytes_stored += record.bytes_stored
            return result if isinstance(result, SlotHandle) else None  # lost: restore recomputes

        return self._worker.submit(work)

    def _reserve_modelled(self, num_tokens: int, codec: str, record: PreemptionRecord) -> SlotHandle | str:
        record.bytes_raw = num_tokens * self.cost_model.target.kv_bytes_per_token
        ratio = 1 / self.mixed_ratio if codec == "mixed" else self.config.modelled_ratio[codec]
        try:
            handle = self.host_pool.reserve(int(record.bytes_raw / ratio))
        except PreemptionHandlerOOM as err:
            return err.reason
        record.bytes_stored = handle.nbytes
        return handle

    def _model_save_time(self, num_tokens: int, codec: str, now: float) -> float:
        device_s, copy_bytes = self._modelled_device_side(num_tokens, codec)
        start = max(now, self._d2h_free_at)
        self._d2h_free_at = start + device_s + self.cost_model.pcie_time_s(copy_bytes)
        self.save_copy_end_s = max(self.save_copy_end_s, self._d2h_free_at)
        return self._d2h_free_at + self._modelled_host_s(copy_bytes, codec, self.config.codec_encode_mb_s)

    def _modelled_device_side(self, num_tokens: int, codec: str) -> tuple[float, float]:
        """(device kernel seconds, bytes over PCIe) of moving `num_tokens` of the
        deployment's KV: `mixed` packs on the device first (one HBM pass reading the raw
        and writing the packed bytes), the others copy raw bytes."""
        nbytes = num_tokens * self.cost_model.target.kv_bytes_per_token
        if codec != "mixed":
            return 0.0, nbytes
        packed = nbytes * self.mixed_ratio
        return self.cost_model.hbm_pass_time_s(nbytes + packed), packed

    def _modelled_host_s(self, nbytes: float, codec: str, mb_s: dict[str, float]) -> float:
        host_s = _codec_time_s(nbytes, mb_s.get(codec, 0.0))
        if codec == "mixed" and self.config.mixed_zstd:
            host_s += _codec_time_s(nbytes, mb_s["zstd"])
        return host_s

    # ----------------------------------------------------------------- restore
    def restore(self, request: Request, now: float, record: PreemptionRecord) -> bool:
        started = time.perf_counter()
        saved = self._saved.pop(id(request))
        handle = saved.handle.result() if isinstance(saved.handle, Future) else saved.handle
        ok = handle is not None and (self.kv_cache is None or self._load_into(request, handle, saved))
        if handle is not None:
            self.host_pool.free(handle)
        record.restored = ok
        if ok and self.plan is not None and saved.codec == "mixed" and self.plan_is_lossy:
            record.warmup_tokens = min(self.config.warmup_tokens, saved.num_tokens)
        if self.is_virtual:
            device_s, copy_bytes = self._modelled_device_side(saved.num_tokens, saved.codec)
            start = max(now, saved.ready_at_s, self._h2d_free_at)
            end = start + self._modelled_host_s(copy_bytes, saved.codec, self.config.codec_decode_mb_s)
            end += self.cost_model.pcie_time_s(copy_bytes) + device_s
            self._h2d_free_at = end
            self.restore_end_s = max(self.restore_end_s, end)
            record.restore_s = end - now
        else:
            record.restore_s = time.perf_counter() - started
            self.engine_thread_s += record.restore_s
        return ok

    @property
    def plan_is_lossy(self) -> bool:
        return self.plan is not None and self.plan.num_fp16 < self.plan.num_layers * self.plan.num_kv_heads

    def _load_into(self, request: Request, handle: SlotHandle, saved: _Saved) -> bool:
        if saved.codec == "mixed":
            return self._load_mixed(request, handle, saved)
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

    def _load_mixed(self, request: Request, handle: SlotHandle, saved: _Saved) -> bool:
        from kernels.restore_blocks import restore_blocks

        kv_cache = self.kv_cache
        try:
            quantized = self.codecs["mixed"].decode_quantized(self.host_pool.load(handle))
        except CorruptBlobError:
            return False
        if (
            quantized.num_tokens != saved.num_tokens
            or quantized.dtype != kv_cache.dtype
            or quantized.head_dim != kv_cache.head_dim
            or (quantized.plan.num_layers, quantized.plan.num_kv_heads)
            != (kv_cache.num_layers, kv_cache.num_kv_heads)
        ):
            return False  # a valid blob, but not this request's KV
        num_blocks = blocks_needed(saved.num_tokens, self.block_size)
        device = kv_cache.kv.device
        dropped = restore_blocks(quantized.to(device), kv_cache.kv, request.block_ids[:num_blocks])
        dropped = dropped.cpu().numpy()
        if dropped.any():  # masked for the rest of the request's life, also across later restores
            previous = request.dropped_heads
            request.dropped_heads = dropped if previous is None else np.logical_or(previous, dropped)
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


# Header and zstd framing above the payload: the header is 36 + 8 * ndim bytes, zstd adds
# a few bytes per 128 KB block of incompressible data.
_HEADER_SLACK = 4096


def _codec_time_s(nbytes: float, mb_per_s: float) -> float:
    return nbytes / (mb_per_s * 1e6) if mb_per_s > 0 else 0.0
