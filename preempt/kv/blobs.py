"""One segment of a request's KV into one host-pool blob, and back into blocks.

Owns: the host pool, the codecs (and the `swap_mixed` head plan they quantize with), the
wall-clock worker threads that encode and store, and the count of stored bytes. A save's
blob: gather the segment's blocks into logical order (or gather and quantize them in one
pass, `mixed`), encode, store into the pool; a restore's: load, decode, check it is this
request's KV, scatter into the request's new blocks. A blob that fails to decode, or
decodes to the wrong shape, is reported unusable (the caller recomputes).

With the `null` backend there is no KV data: a blob is a reservation of the modelled
size (the target's KV over the codec's assumed ratio, `preemption.modelled_ratio`; for
`mixed`, the plan's ratio). Acting code: it never decides whom to save.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from preempt.core.block_pool import blocks_needed
from preempt.core.config import ConfigError, EngineConfig, PreemptionConfig
from preempt.core.cost_model import CostModel
from preempt.core.request import Request
from preempt.kv.codec import CorruptBlobError, MixedCodec, make_codec
from preempt.kv.host_pool import HostPool, PreemptionHandlerOOM, SlotHandle
from preempt.kv.kv_cache import KVCache
from preempt.kv.segment import SavedCopy, Segment, blob_bound, resolve


def head_plan_for(config: PreemptionConfig, num_layers: int, num_kv_heads: int, seed: int):
    """The `swap_mixed` head plan of a model with this many layers and KV heads."""
    from preempt.kernels.plan import HeadPlan

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
    if not plan.is_legacy:
        # KIVI / per-token classes cost depends on the length and head_dim: price them at a
        # nominal 1024-token request of 128-wide heads (Llama-3-8B's), scales included.
        from preempt.kernels.plan import size_vs_fp16

        return size_vs_fp16(plan, 1024, 128)
    total = plan.num_layers * plan.num_kv_heads
    return (2 * plan.num_fp16 + plan.num_fp8) / (2 * total)


class BlobStore:
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None, cost_model: CostModel, block_size: int
    ) -> None:
        p = config.preemption
        self.config = p
        self.host_pool = HostPool(p.host_mem, p.slot_size, allocate=kv_cache is not None)
        self.codecs = {
            "raw": make_codec("raw"),
            "zstd": make_codec("zstd", level=p.zstd_level, threads=p.zstd_threads, shuffle=p.zstd_shuffle),
        }
        self.plan = None  # swap_mixed: the head plan, shaped like the KV this store moves
        self.mixed_ratio = 1.0  # the plan's stored bytes over 16-bit KV
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
                raise ConfigError(f"config key 'preemption.head_plan': {err}") from None
            self.mixed_ratio = plan_size_ratio(self.plan)
            self.codecs["mixed"] = MixedCodec(self.plan, zstd=p.mixed_zstd, level=p.zstd_level)
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.block_size = block_size
        is_virtual = config.clock.kind == "virtual"
        # Wall clock: demand saves and early saves encode on separate threads, so a queue of
        # speculative work never delays a preemption's save.
        self._worker = None if is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-saver")
        self._early_worker = None if is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-early")
        self._lock = threading.Lock()  # the stored-byte count, written by the workers too
        self.bytes_stored = 0

    def __deepcopy__(self, memo: dict[int, object]) -> BlobStore:
        """A model of this store (an engine fork's, virtual clock): its slots, sizes and
        byte counts copied, no KV cache (it moves no data), the codecs and plan shared."""
        if self._worker is not None:
            raise ValueError("a blob store on the wall clock (worker threads) cannot be copied")
        copied = object.__new__(BlobStore)
        memo[id(self)] = copied
        fresh = {"kv_cache": None, "_lock": threading.Lock()}
        shared = {"config", "codecs", "plan", "cost_model"}
        for name, value in self.__dict__.items():
            if name in fresh:
                value = fresh[name]
            elif name not in shared:
                value = copy.deepcopy(value, memo)
            setattr(copied, name, value)
        return copied

    @property
    def plan_is_lossy(self) -> bool:
        return self.plan is not None and self.plan.num_fp16 < self.plan.num_layers * self.plan.num_kv_heads

    def raw_bytes(self, num_tokens: int) -> int:
        """Uncompressed bytes of `num_tokens` of KV as this backend holds them."""
        if self.kv_cache is None:
            return num_tokens * self.cost_model.target.kv_bytes_per_token
        return blocks_needed(num_tokens, self.block_size) * self.block_size * self.kv_cache.bytes_per_token

    # ----------------------------------------------------------------- store
    def store(self, request: Request, segment: Segment, speculative: bool) -> str | None:
        """Copy the segment's tokens out of the request's blocks into a blob (now on the
        virtual clock; the encode and store on a worker on the wall clock). The failure
        reason if the pool cannot take it; the blob's size comes through `segment.stored`."""
        if self.kv_cache is None:
            return self._reserve_modelled(segment)
        block_ids = request.block_ids[segment.start // self.block_size :]
        make_parts, bound = self._prepare(block_ids, segment)
        if self._worker is None:
            return self._store(make_parts, segment)
        worker = self._early_worker if speculative else self._worker
        return self._store_async(make_parts, bound, segment, worker)

    def _prepare(self, block_ids: list[int], segment: Segment) -> tuple[Callable[[], list], int]:
        """Copy the segment's KV out of its blocks now (they may be freed right after) and
        return (the encoder of the blob's parts, an upper bound of the blob's size).

        Whole blocks for the lossless codecs: copying block-sized runs is faster than
        token-sized ones, and the last block's unused slots ride along. `mixed` gathers and
        quantizes in one pass over exactly the segment's tokens."""
        num_tokens = segment.num_tokens
        num_blocks = blocks_needed(num_tokens, self.block_size)
        segment.nbytes_raw = self.raw_bytes(num_tokens)
        if segment.codec == "mixed":
            from preempt.kernels.quantize_heads import gather_quantize_heads

            quantized = gather_quantize_heads(self.kv_cache.kv, block_ids[:num_blocks], num_tokens, self.plan)
            quantized = quantized.to("cpu")
            mixed = self.codecs["mixed"]
            return (lambda: mixed.encode_quantized(quantized)), blob_bound(quantized.nbytes)
        kv = self.kv_cache.read_blocks(block_ids[:num_blocks])  # (L, 2, n, bs, H, D), a copy
        codec = self.codecs[segment.codec]
        return (lambda: codec.encode_parts(kv)), blob_bound(segment.nbytes_raw)

    def _store(
        self, make_parts: Callable[[], list], segment: Segment, into: SlotHandle | None = None
    ) -> str | None:
        """Encode and store the segment's blob (into the reserved slot `into`, if given)."""
        try:
            parts = make_parts()
        except BaseException:
            if into is not None:
                self.host_pool.free(into)
            raise
        try:
            segment.handle = self.host_pool.store(parts, into=into)  # releases `into` if it fails
        except PreemptionHandlerOOM as err:
            return err.reason
        self._count_stored(segment, segment.handle.nbytes)
        return None

    def _count_stored(self, segment: Segment, nbytes: int) -> None:
        """The segment's blob is in the pool (workers call this too): count it, and report
        its size through the segment's future."""
        with self._lock:
            self.bytes_stored += nbytes
        segment.stored.set_result(nbytes)

    def _store_async(
        self, make_parts: Callable[[], list], bound: int, segment: Segment, worker: ThreadPoolExecutor
    ) -> str | None:
        # Failures must be known now (the scheduler decides on them): reserve the slot now
        # for `bound` bytes (the packed or raw size plus header/zstd framing); the worker
        # fills it and shrinks the reservation to the blob's real size.
        try:
            reservation = self.host_pool.reserve(bound)
        except PreemptionHandlerOOM as err:
            return err.reason

        def work() -> SlotHandle | None:
            try:
                failure = self._store(make_parts, segment, into=reservation)
            finally:
                if not segment.stored.done():  # lost (pool) or failed (encode): nothing stored
                    segment.stored.set_result(0)
            return None if failure else segment.handle  # lost: the restore recomputes

        segment.handle = worker.submit(work)
        return None

    def _reserve_modelled(self, segment: Segment) -> str | None:
        segment.nbytes_raw = self.raw_bytes(segment.num_tokens)
        # Stored share of the raw bytes: the plan's for mixed (0 for an all-DROP plan).
        share = (
            self.mixed_ratio if segment.codec == "mixed" else 1 / self.config.modelled_ratio[segment.codec]
        )
        try:
            segment.handle = self.host_pool.reserve(int(segment.nbytes_raw * share))
        except PreemptionHandlerOOM as err:
            return err.reason
        self._count_stored(segment, segment.handle.nbytes)
        return None

    # ----------------------------------------------------------------- load
    def load(
        self, request: Request, saved: SavedCopy, handles: list[SlotHandle | None]
    ) -> tuple[bool, np.ndarray | None]:
        """Write the saved segments into the request's blocks: (usable, dropped heads (L, H))."""
        dropped = None if self.kv_cache is None else np.zeros(self._heads_shape, dtype=bool)
        ok = all(handle is not None for handle in handles) and (
            self.kv_cache is None
            or all(
                self._load_segment(request, handle, segment, dropped)
                for handle, segment in zip(handles, saved.segments, strict=True)
            )
        )
        return ok, dropped

    @property
    def _heads_shape(self) -> tuple[int, int]:
        return (self.kv_cache.num_layers, self.kv_cache.num_kv_heads)

    def _load_segment(
        self, request: Request, handle: SlotHandle, segment: Segment, dropped: np.ndarray
    ) -> bool:
        """Write one segment into the request's blocks; `dropped` (L, H) collects the heads
        a mixed segment did not store."""
        block_ids = request.block_ids[segment.start // self.block_size :]
        if segment.codec == "mixed":
            return self._load_mixed(block_ids, handle, segment, dropped)
        kv_cache = self.kv_cache
        try:
            kv = self.codecs[segment.codec].decode(self.host_pool.load(handle))  # (L, 2, n, bs, H, D)
        except CorruptBlobError:
            return False
        num_blocks = blocks_needed(segment.num_tokens, self.block_size)
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
        kv_cache.write_blocks(block_ids[:num_blocks], kv)
        return True

    def _load_mixed(
        self, block_ids: list[int], handle: SlotHandle, segment: Segment, dropped: np.ndarray
    ) -> bool:
        from preempt.kernels.restore_blocks import restore_blocks

        kv_cache = self.kv_cache
        try:
            quantized = self.codecs["mixed"].decode_quantized(self.host_pool.load(handle))
        except CorruptBlobError:
            return False
        if (
            quantized.num_tokens != segment.num_tokens
            or quantized.dtype != kv_cache.dtype
            or quantized.head_dim != kv_cache.head_dim
            or (quantized.plan.num_layers, quantized.plan.num_kv_heads)
            != (kv_cache.num_layers, kv_cache.num_kv_heads)
        ):
            return False  # a valid blob, but not this request's KV
        num_blocks = blocks_needed(segment.num_tokens, self.block_size)
        device = kv_cache.kv.device
        dropped |= restore_blocks(quantized.to(device), kv_cache.kv, block_ids[:num_blocks]).cpu().numpy()
        return True

    # ----------------------------------------------------------------- free
    def free(self, segment: Segment) -> None:
        """Free the segment's slot (waiting for its worker if it is still storing)."""
        handle = resolve(segment.handle)
        if handle is not None:
            self.host_pool.free(handle)

    def close(self) -> None:
        """Join the workers (every queued store finishes first), then free the host pool's
        buffer. Idempotent."""
        for worker in (self._worker, self._early_worker):
            if worker is not None:
                worker.shutdown(wait=True)
        self.host_pool.close()
