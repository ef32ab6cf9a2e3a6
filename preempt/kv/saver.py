"""Moves preempted requests' KV: device blocks -> codec -> host slot, and back.

Owns: the save/restore data path (gather blocks into logical order, encode, store into
the host pool; load, decode, scatter into newly allocated blocks), the host copies of
preempted requests (`SavedCopy`, one owner: this saver), the checksum fallback (a blob
that fails to decode is dropped and the request recomputed, counted) and the wall-clock
workers. Whom to save, restore or prefetch is decided elsewhere (the scheduler, early
saves, the prefetcher); what each move costs in virtual time is `preempt.kv.timing`;
the speculative copies' bookkeeping is `preempt.kv.speculative`.

Results, not blackboards: `save` returns a `SaveResult` (bytes copied, time, and a
future of the stored bytes, which on the wall clock the worker thread learns later) and
`restore` a `RestoreResult`; the scheduler writes them into its own `PreemptionRecord`.

Clocks. On the virtual clock data still moves for real on the `tiny` backend (bit-exact
round trips are tested), but instantly in virtual time: the modelled times come from
`VirtualTiming`. On the wall clock, the gather runs on the engine thread and encode +
store on a worker thread, so compression overlaps the next steps.

Mixed precision (`swap_mixed`). The save quantizes on the device, fused with the block
gather (`kernels.quantize_heads`: Triton on CUDA, its torch reference on CPU), so only the
packed bytes cross PCIe; the restore dequantizes into the new blocks
(`kernels.restore_blocks`), marks the plan's dropped heads on the request (attention
masks their restored prefix for the rest of its life) and reports `warmup_tokens` for the
scheduler to recompute at full precision.

Sizes. Host-pool bytes are the bytes of the backend that stores them: the tiny model's
real KV, or, with the `null` backend (no KV data), the target's modelled KV divided by
the codec's assumed ratio (`preemption.modelled_ratio`; for `mixed`, the plan's ratio).
"""

from __future__ import annotations

import threading
import time
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
from preempt.kv.record import MODE_CODEC, KVMover, RestoreResult, SaveResult
from preempt.kv.segment import SavedCopy, Segment, blob_bound, gather_stored, resolve
from preempt.kv.speculative import EarlyCopies, Predecoded, Prefetched, RestoresAhead
from preempt.kv.timing import VirtualTiming


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
    if not plan.is_legacy:
        # KIVI / per-token classes cost depends on the length and head_dim: price them at a
        # nominal 1024-token request of 128-wide heads (Llama-3-8B's), scales included.
        from kernels.plan import size_vs_fp16

        return size_vs_fp16(plan, 1024, 128)
    total = plan.num_layers * plan.num_kv_heads
    return (2 * plan.num_fp16 + plan.num_fp8) / (2 * total)


class Saver(KVMover):
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None, cost_model: CostModel, block_size: int
    ):
        p = config.preemption
        self.config = p
        self.early_config = config.early_save
        self.host_pool = HostPool(p.host_mem, p.slot_size, allocate=kv_cache is not None)
        self.codecs = {
            "raw": make_codec("raw"),
            "zstd": make_codec("zstd", level=p.zstd_level, threads=p.zstd_threads, shuffle=p.zstd_shuffle),
        }
        self.plan = None  # swap_mixed: the head plan, shaped like the KV this saver moves
        mixed_ratio = 1.0  # the plan's stored bytes over 16-bit KV (virtual timing)
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
            mixed_ratio = plan_size_ratio(self.plan)
            self.codecs["mixed"] = MixedCodec(self.plan, zstd=p.mixed_zstd, level=p.zstd_level)
        self.mixed_ratio = mixed_ratio
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.block_size = block_size
        self.is_virtual = config.clock.kind == "virtual"
        self.timing = VirtualTiming(
            p,
            cost_model,
            mixed_ratio,
            staged_restores=config.early_save.prefetch,
            num_decode_lanes=config.early_save.prefetch_decode_threads,
        )
        # Wall clock: demand saves and early saves encode on separate threads, so a queue of
        # speculative work never delays a preemption's save.
        self._worker = None if self.is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-saver")
        self._early_worker = None if self.is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-early")
        self._lock = threading.Lock()  # the stored-byte count, written by the workers too
        # Keyed by the request object (identity, and a live reference: an id() could be
        # reused by a new request once an old one is garbage-collected).
        self._saved: dict[Request, SavedCopy] = {}  # host copy of a preempted request
        self.early = EarlyCopies()  # early segments of running requests
        self.ahead = RestoresAhead()  # restore prefetch (preempt.engine.prefetch)
        self.bytes_raw = 0
        self.bytes_stored = 0
        self.engine_thread_s = 0.0  # wall clock: time the engine thread spent saving/restoring
        self.early_thread_s = 0.0  # wall clock: the engine thread's share of early saves

    # ----------------------------------------------------------------- virtual time
    @property
    def save_copy_end_s(self) -> float:
        """Virtual: when the latest save's copy-out ends (its freed blocks are busy till then)."""
        return self.timing.save_copy_end_s

    @property
    def restore_end_s(self) -> float:
        """Virtual: when the latest restore's copy-in ends."""
        return self.timing.restore_end_s

    # ----------------------------------------------------------------- save
    def save(self, request: Request, codec: str, now: float) -> SaveResult:
        started = time.perf_counter()
        num_tokens = request.num_computed_tokens
        early = self.early.take(request)
        covered = sum(segment.num_tokens for segment in early)
        if covered > num_tokens:  # cannot happen while KV only grows; never trust a stale copy
            self._free_segments(early, wasted=True)
            early, covered = [], 0
        tail = self._save_segment(request, covered, num_tokens, codec, now, speculative=False)
        if tail == "pool_full" and self._evict_speculative():  # demand saves come first
            tail = self._save_segment(request, covered, num_tokens, codec, now, speculative=False)
        if isinstance(tail, str):
            self._free_segments(early, wasted=True)
            return SaveResult(tail)
        self.early.claimed(early)
        segments = [*early, tail] if tail.num_tokens else early
        # The victim's blocks are reusable once its own copies are out (not anyone else's).
        self.timing.blocks_freed(max([0.0, *(segment.copy_end_s for segment in segments)]))
        if self.is_virtual:
            save_s = max([now, *(segment.ready_at_s for segment in segments)]) - now
        else:
            save_s = time.perf_counter() - started  # the engine thread's share
            self.engine_thread_s += save_s
        self._saved[request] = SavedCopy(segments, num_tokens)
        self.bytes_raw += tail.nbytes_raw
        return SaveResult(
            None,
            bytes_raw=tail.nbytes_raw,
            bytes_early=sum(segment.nbytes_raw for segment in early),
            save_s=save_s,
            bytes_stored=gather_stored(segments),
        )

    def early_save(self, request: Request, now: float) -> bool:
        """Copy the request's full blocks not yet on the host, speculatively, while it keeps
        running. False (nothing done) when there is nothing new, the speculation budget or
        the in-flight bound is reached, or the host pool has no slot to spare."""
        started = time.perf_counter()
        covered = self.early.covered(request)
        end = request.num_computed_tokens // self.block_size * self.block_size  # full blocks only
        if end <= covered or not self._early_allowed(end - covered, now):
            return False
        segment = self._save_segment(request, covered, end, self._early_codec(), now, speculative=True)
        if isinstance(segment, str):
            return False
        self.early.add(request, segment)
        self.bytes_raw += segment.nbytes_raw
        if not self.is_virtual:
            self.early_thread_s += time.perf_counter() - started
        return True

    def discard_early(self, request: Request) -> None:
        """The request finished (or left the batch for good): its early copies were wasted."""
        self._free_segments(self.early.take(request), wasted=True)

    def _early_codec(self) -> str:
        return MODE_CODEC.get(self.config.mode, self.config.reclaim_codec)

    def _early_allowed(self, num_tokens: int, now: float) -> bool:
        cfg = self.early_config
        if self.early.speculative_bytes + self._raw_bytes(num_tokens) > cfg.host_budget:
            return False
        if self.early.num_in_flight(now) >= cfg.max_inflight:
            return False
        return self.host_pool.num_free_slots > 1  # keep a slot free for the next demand save

    def _evict_speculative(self) -> bool:
        """Free every unclaimed early copy (of running requests) to make room for a demand
        save; True if anything was freed."""
        victims = self.early.evictable()
        for segments in victims:
            self._free_segments(segments, wasted=True)
            segments.clear()
        return bool(victims)

    def _raw_bytes(self, num_tokens: int) -> int:
        if self.kv_cache is None:
            return num_tokens * self.cost_model.target.kv_bytes_per_token
        return blocks_needed(num_tokens, self.block_size) * self.block_size * self.kv_cache.bytes_per_token

    def _save_segment(
        self, request: Request, start: int, end: int, codec: str, now: float, speculative: bool
    ) -> Segment | str:
        """Save tokens [start, end) (start block-aligned) into one host blob, for a
        preemption or speculatively. The failure reason if it cannot be kept."""
        segment = Segment(None, codec, start, end - start, 0, now, speculative)
        if end == start:
            segment.stored.set_result(0)
            return segment
        if self.kv_cache is None:
            failure = self._reserve_modelled(segment)
        else:
            block_ids = request.block_ids[start // self.block_size :]
            make_parts, bound = self._prepare(block_ids, segment)
            if self._worker is None:
                failure = self._store(make_parts, segment)
            else:
                worker = self._early_worker if speculative else self._worker
                failure = self._store_async(make_parts, bound, segment, worker)
        if failure is not None:
            return failure
        if self.is_virtual:
            segment.copy_end_s, segment.ready_at_s = self.timing.save(
                segment.num_tokens, codec, now, speculative
            )
        return segment

    def _prepare(self, block_ids: list[int], segment: Segment) -> tuple[Callable[[], list], int]:
        """Copy the segment's KV out of its blocks now (they may be freed right after) and
        return (the encoder of the blob's parts, an upper bound of the blob's size).

        Whole blocks for the lossless codecs: copying block-sized runs is faster than
        token-sized ones, and the last block's unused slots ride along. `mixed` gathers and
        quantizes in one pass over exactly the segment's tokens."""
        num_tokens = segment.num_tokens
        num_blocks = blocks_needed(num_tokens, self.block_size)
        segment.nbytes_raw = self._raw_bytes(num_tokens)
        if segment.codec == "mixed":
            from kernels.quantize_heads import gather_quantize_heads

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
        """The segment's blob is in the pool (workers call this too): count it in the
        saver's total, and report its size through the segment's future."""
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
        segment.nbytes_raw = self._raw_bytes(segment.num_tokens)
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

    # ----------------------------------------------------------------- restore
    def restore(self, request: Request, now: float) -> RestoreResult:
        started = time.perf_counter()
        saved = self._saved.pop(request)
        handles = [resolve(segment.handle) for segment in saved.segments]
        prefetched, predecoded = self.ahead.claim(request)
        if prefetched is not None:
            ok, dropped = prefetched.ok, prefetched.dropped
        else:
            ok, dropped = self._load_saved(request, saved, handles)
            if predecoded is None and self.early_config.prefetch:
                self.ahead.num_prefetch_misses += 1
        for handle in handles:
            if handle is not None:
                self.host_pool.free(handle)
        warmup_tokens = 0
        if ok and any(segment.codec == "mixed" for segment in saved.segments) and self.plan_is_lossy:
            warmup_tokens = min(self.config.warmup_tokens, saved.num_tokens)
        if ok and dropped is not None and dropped.any():
            # The dropped heads' restored keys are zeros: masked for the rest of the request,
            # except the warm-up tokens, which are recomputed at full precision.
            masked = np.where(dropped, saved.num_tokens - warmup_tokens, 0)
            previous = request.kv_masked_until
            request.kv_masked_until = masked if previous is None else np.maximum(previous, masked)
        if self.is_virtual:
            if prefetched is not None:
                end = prefetched.end_s
            else:
                decoded_s = predecoded.end_s if predecoded is not None else None
                end = self.timing.restore_end(saved, now, decoded_s)
            self.timing.restored(end)
            restore_s = max(0.0, end - now)
        else:
            restore_s = time.perf_counter() - started
            self.engine_thread_s += restore_s
        return RestoreResult(ok, warmup_tokens, restore_s)

    def _load_saved(
        self, request: Request, saved: SavedCopy, handles: list[SlotHandle | None]
    ) -> tuple[bool, np.ndarray | None]:
        """Write the saved segments into the request's blocks: (usable, dropped heads)."""
        dropped = None if self.kv_cache is None else np.zeros(self._heads_shape, dtype=bool)
        ok = all(handle is not None for handle in handles) and (
            self.kv_cache is None
            or all(
                self._load_segment(request, handle, segment, dropped)
                for handle, segment in zip(handles, saved.segments, strict=True)
            )
        )
        return ok, dropped

    # ----------------------------------------------------------------- prefetch
    def is_prefetched(self, request: Request) -> bool:
        return request in self.ahead.prefetched

    def is_predecoded(self, request: Request) -> bool:
        return request in self.ahead.predecoded

    @property
    def prefetched_requests(self) -> list[Request]:
        return list(self.ahead.prefetched)

    def saved_bytes(self, request: Request) -> int:
        """Raw bytes of a waiting request's host copy."""
        return sum(segment.nbytes_raw for segment in self._saved[request].segments)

    def needs_decode(self, request: Request) -> bool:
        """Its host copy costs host decode time on restore (zstd, mixed+zstd)."""
        return self.timing.needs_decode(self._saved[request])

    def predecode(self, request: Request, now: float) -> int:
        """Start decoding a waiting request's host copy now, ahead of its restore (no
        device blocks needed); returns the decoded bytes it will hold on the host."""
        saved = self._saved[request]
        if request in self.ahead.predecoded:
            raise ValueError(f"request {request.request_id} is already predecoded")
        end = self.timing.predecode_end(saved, now)
        nbytes = sum(segment.nbytes_raw for segment in saved.segments)
        self.ahead.add_predecode(request, Predecoded(end, nbytes))
        return nbytes

    def prefetch(self, request: Request, now: float) -> None:
        """Restore a waiting request's saved KV now into the blocks it already holds
        (`request.block_ids`, given by the prefetcher, covering its computed tokens), in
        the background on the virtual clock; `restore` at admission then only claims it.
        The host copy stays until then: a cancelled prefetch loses only the copy-in."""
        saved = self._saved[request]
        if request in self.ahead.prefetched:
            raise ValueError(f"request {request.request_id} is already prefetched")
        if len(request.block_ids) < blocks_needed(saved.num_tokens, self.block_size):
            raise ValueError(f"request {request.request_id}: its blocks do not cover its saved KV")
        handles = [resolve(segment.handle) for segment in saved.segments]
        ok, dropped = self._load_saved(request, saved, handles)
        predecoded = self.ahead.predecoded.get(request)
        end = self.timing.restore_end(saved, now, predecoded.end_s if predecoded is not None else None)
        nbytes = sum(segment.nbytes_raw for segment in saved.segments)
        self.ahead.add_prefetch(request, Prefetched(list(request.block_ids), ok, dropped, end, nbytes))

    def cancel_prefetch(self, request: Request) -> None:
        """Drop a prefetched restore (its blocks are needed elsewhere; the caller frees
        them): the host copy remains, the copy-in was wasted."""
        self.ahead.cancel(request)

    @property
    def plan_is_lossy(self) -> bool:
        return self.plan is not None and self.plan.num_fp16 < self.plan.num_layers * self.plan.num_kv_heads

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
        from kernels.restore_blocks import restore_blocks

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

    # ----------------------------------------------------------------- cleanup
    def discard(self, request: Request) -> None:
        """Drop every host copy of an aborted request (saved, early, done ahead)."""
        saved = self._saved.pop(request, None)
        if saved is not None:
            self._free_segments(saved.segments, wasted=False)
        self.ahead.discard(request)
        self.discard_early(request)

    def _free_segments(self, segments: list[Segment], wasted: bool) -> None:
        for segment in segments:
            handle = resolve(segment.handle)
            if handle is not None:
                self.host_pool.free(handle)
            self.early.freed(segment, wasted)

    def stats(self) -> dict[str, int | float]:
        early = self.early
        return {
            "kv_saved_bytes_raw": self.bytes_raw,
            "kv_saved_bytes_stored": self.bytes_stored,
            "host_pool_peak_bytes": self.host_pool.peak_bytes_used,
            "num_early_saves": early.num_early_saves,
            "early_bytes_raw": early.early_bytes_raw,
            "early_bytes_used": early.early_bytes_used,
            "early_bytes_wasted": early.early_bytes_wasted,
            **(self.ahead.stats() if self.early_config.prefetch else {}),
        }

    def close(self) -> None:
        for worker in (self._worker, self._early_worker):
            if worker is not None:
                worker.shutdown(wait=True)


