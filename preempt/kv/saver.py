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
masks their restored prefix for the rest of its life) and reports `warmup_tokens` for the scheduler to
recompute at full precision. Virtual time: one HBM pass (raw in, packed out), PCIe of the
packed bytes (the target's KV times the plan's size ratio at 16 bits), host zstd only with
`mixed_zstd`.

Sizes. Host-pool bytes are the bytes of the backend that stores them: the tiny model's
real KV, or, with the `null` backend (no KV data), the target's modelled KV divided by
the codec's assumed ratio (`preemption.modelled_ratio`; for `mixed`, the plan's ratio).

Over 500 lines, and not one concept: the data path, virtual vs wall timing, early copies
and restore prefetch live together here; splitting them (one owner per piece of state,
results through futures) is the next step of issue #14.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from preempt.core.block_pool import blocks_needed
from preempt.core.config import ConfigError, EngineConfig, PreemptionConfig
from preempt.core.cost_model import CostModel
from preempt.core.request import Request
from preempt.kv.codec import CorruptBlobError, MixedCodec, make_codec
from preempt.kv.host_pool import HostPool, PreemptionHandlerOOM, SlotHandle
from preempt.kv.kv_cache import KVCache
from preempt.kv.record import MODE_CODEC, KVMover, PreemptionRecord


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


@dataclass
class _Segment:
    """One blob on the host: tokens [start, start + num_tokens) of a request's KV. A save is
    one segment, or, after early saves, the early segments plus the tail written since."""

    handle: SlotHandle | Future | None  # a Future while the worker is still encoding
    codec: str
    start: int  # first token; block-aligned
    num_tokens: int
    nbytes_raw: int
    ready_at_s: float  # virtual: when the host copy is complete
    speculative: bool = False  # an early save not (yet) claimed by a preemption
    nbytes_stored: int = 0  # set when the blob is stored (by the worker on the wall clock)
    record: PreemptionRecord | None = None  # the preemption whose bytes_stored it counts in
    copy_end_s: float = 0.0  # virtual: when its device-to-host copy ends (blocks reusable)


@dataclass
class _Saved:
    segments: list[_Segment]
    num_tokens: int


@dataclass
class _Prefetched:
    """A restore started before admission (preempt.engine.prefetch): the KV already sits in the
    request's blocks `block_ids`; the host copy stays until the restore claims it."""

    block_ids: list[int]
    ok: bool
    dropped: np.ndarray | None
    end_s: float  # virtual: when its host-to-device copy ends
    nbytes: int  # raw bytes copied in


@dataclass
class _Predecoded:
    """A host decode started before admission: the decoded KV waits in host memory."""

    end_s: float  # virtual: when the decode ends
    nbytes: int  # decoded (raw) bytes held on the host


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
                raise ConfigError(f"config key 'preemption.head_plan': {err}") from None
            self.mixed_ratio = plan_size_ratio(self.plan)
            self.codecs["mixed"] = MixedCodec(self.plan, zstd=p.mixed_zstd, level=p.zstd_level)
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.block_size = block_size
        self.is_virtual = config.clock.kind == "virtual"
        # Wall clock: demand saves and early saves encode on separate threads, so a queue of
        # speculative work never delays a preemption's save.
        self._worker = None if self.is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-saver")
        self._early_worker = None if self.is_virtual else ThreadPoolExecutor(1, thread_name_prefix="kv-early")
        self._lock = threading.Lock()  # stored-byte counts, written by the workers too
        # Keyed by the request object (identity, and a live reference: an id() could be
        # reused by a new request once an old one is garbage-collected).
        self._saved: dict[Request, _Saved] = {}  # host copy of a preempted request
        self._early: dict[Request, list[_Segment]] = {}  # early segments of a running one
        self._d2h_free_at = 0.0  # virtual: demand saves' copy timeline
        self._early_d2h_free_at = 0.0  # virtual: speculative copies, below demand saves
        self._h2d_free_at = 0.0
        self.save_copy_end_s = 0.0  # virtual: when the latest save's copy-out ends
        self.restore_end_s = 0.0  # virtual: when the latest restore's copy-in ends
        self.bytes_raw = 0
        self.bytes_stored = 0
        self.engine_thread_s = 0.0  # wall clock: time the engine thread spent saving/restoring
        self.early_thread_s = 0.0  # wall clock: the engine thread's share of early saves
        # Early saves: how many, their raw bytes, and what became of them.
        self.num_early_saves = 0
        self.early_bytes_raw = 0
        self.early_bytes_used = 0  # claimed by a preemption: that much less to copy then
        self.early_bytes_wasted = 0  # freed unused: the request finished, or evicted for space
        self.speculative_bytes = 0  # raw bytes of unclaimed early segments held now
        # Restore prefetch (preempt.engine.prefetch): every prefetched byte ends used or wasted.
        self._prefetched: dict[Request, _Prefetched] = {}
        self._predecoded: dict[Request, _Predecoded] = {}
        # Virtual: the prefetch's host decode threads (free-at times), one blob each.
        self._decode_free_at = [0.0] * config.early_save.prefetch_decode_threads
        self.num_predecodes = 0
        self.predecode_bytes = 0
        self.predecode_bytes_used = 0
        self.predecode_bytes_wasted = 0  # the request was aborted
        self.num_prefetches = 0
        self.num_prefetch_hits = 0  # restores that found their KV prefetched
        self.num_prefetch_misses = 0  # restores (with prefetch on) that had to start then
        self.prefetch_bytes = 0
        self.prefetch_bytes_used = 0
        self.prefetch_bytes_wasted = 0  # cancelled (blocks needed) or the request aborted

    # ----------------------------------------------------------------- save
    def save(self, request: Request, codec: str, now: float, record: PreemptionRecord) -> str | None:
        started = time.perf_counter()
        num_tokens = request.num_computed_tokens
        early = self._early.pop(request, [])
        covered = sum(segment.num_tokens for segment in early)
        if covered > num_tokens:  # cannot happen while KV only grows; never trust a stale copy
            self._free_segments(early, wasted=True)
            early, covered = [], 0
        tail = self._save_segment(request, covered, num_tokens, codec, now, record)
        if tail == "pool_full" and self._evict_speculative():  # demand saves come first
            tail = self._save_segment(request, covered, num_tokens, codec, now, record)
        if isinstance(tail, str):
            self._free_segments(early, wasted=True)
            return tail
        for segment in early:  # claimed: no longer speculation
            segment.speculative = False
            self.speculative_bytes -= segment.nbytes_raw
            self.early_bytes_used += segment.nbytes_raw
            with self._lock:  # its size may still be on the early worker
                segment.record = record
                record.bytes_stored += segment.nbytes_stored
        segments = [*early, tail] if tail.num_tokens else early
        # The victim's blocks are reusable once its own copies are out (not anyone else's).
        self.save_copy_end_s = max(self.save_copy_end_s, *(segment.copy_end_s for segment in segments))
        record.bytes_raw = tail.nbytes_raw
        record.bytes_early = sum(segment.nbytes_raw for segment in early)
        if self.is_virtual:
            record.save_s = max([now, *(segment.ready_at_s for segment in segments)]) - now
        else:
            record.save_s = time.perf_counter() - started  # the engine thread's share
            self.engine_thread_s += record.save_s
        self._saved[request] = _Saved(segments, num_tokens)
        self.bytes_raw += tail.nbytes_raw
        return None

    def early_save(self, request: Request, now: float) -> bool:
        """Copy the request's full blocks not yet on the host, speculatively, while it keeps
        running. False (nothing done) when there is nothing new, the speculation budget or
        the in-flight bound is reached, or the host pool has no slot to spare."""
        started = time.perf_counter()
        segments = self._early.setdefault(request, [])
        covered = sum(segment.num_tokens for segment in segments)
        end = request.num_computed_tokens // self.block_size * self.block_size  # full blocks only
        if end <= covered or not self._early_allowed(end - covered, now):
            return False
        segment = self._save_segment(request, covered, end, self._early_codec(), now, record=None)
        if isinstance(segment, str):
            return False
        segments.append(segment)
        self.num_early_saves += 1
        self.early_bytes_raw += segment.nbytes_raw
        self.speculative_bytes += segment.nbytes_raw
        self.bytes_raw += segment.nbytes_raw
        if not self.is_virtual:
            self.early_thread_s += time.perf_counter() - started
        return True

    def discard_early(self, request: Request) -> None:
        """The request finished (or left the batch for good): its early copies were wasted."""
        self._free_segments(self._early.pop(request, []), wasted=True)

    def _early_codec(self) -> str:
        return MODE_CODEC.get(self.config.mode, self.config.reclaim_codec)

    def _early_allowed(self, num_tokens: int, now: float) -> bool:
        cfg = self.early_config
        if self.speculative_bytes + self._raw_bytes(num_tokens) > cfg.host_budget:
            return False
        in_flight = sum(
            1 for segments in self._early.values() for segment in segments if _in_flight(segment, now)
        )
        if in_flight >= cfg.max_inflight:
            return False
        return self.host_pool.num_free_slots > 1  # keep a slot free for the next demand save

    def _evict_speculative(self) -> bool:
        """Free every unclaimed early copy (of running requests) to make room for a demand
        save; True if anything was freed."""
        victims = [segments for segments in self._early.values() if segments]
        for segments in victims:
            self._free_segments(segments, wasted=True)
            segments.clear()
        return bool(victims)

    def _raw_bytes(self, num_tokens: int) -> int:
        if self.kv_cache is None:
            return num_tokens * self.cost_model.target.kv_bytes_per_token
        return blocks_needed(num_tokens, self.block_size) * self.block_size * self.kv_cache.bytes_per_token

    def _save_segment(
        self, request: Request, start: int, end: int, codec: str, now: float, record: PreemptionRecord | None
    ) -> _Segment | str:
        """Save tokens [start, end) (start block-aligned) into one host blob: for a
        preemption (`record`) or speculatively (None). The failure reason if it cannot be
        kept."""
        speculative = record is None
        segment = _Segment(None, codec, start, end - start, 0, now, speculative, record=record)
        if end == start:
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
            segment.copy_end_s, segment.ready_at_s = self._model_save_time(
                segment.num_tokens, codec, now, speculative
            )
        return segment

    def _prepare(self, block_ids: list[int], segment: _Segment) -> tuple[Callable[[], list], int]:
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
            return (lambda: mixed.encode_quantized(quantized)), _blob_bound(quantized.nbytes)
        kv = self.kv_cache.read_blocks(block_ids[:num_blocks])  # (L, 2, n, bs, H, D), a copy
        codec = self.codecs[segment.codec]
        return (lambda: codec.encode_parts(kv)), _blob_bound(segment.nbytes_raw)

    def _store(
        self, make_parts: Callable[[], list], segment: _Segment, into: SlotHandle | None = None
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
        self._count_stored(segment)
        return None

    def _count_stored(self, segment: _Segment) -> None:
        """The segment's blob is in the pool: count its size (workers call this too)."""
        with self._lock:
            segment.nbytes_stored = segment.handle.nbytes
            self.bytes_stored += segment.nbytes_stored
            if segment.record is not None:
                segment.record.bytes_stored += segment.nbytes_stored

    def _store_async(
        self, make_parts: Callable[[], list], bound: int, segment: _Segment, worker: ThreadPoolExecutor
    ) -> str | None:
        # Failures must be known now (the scheduler decides on them): reserve the slot now
        # for `bound` bytes (the packed or raw size plus header/zstd framing); the worker
        # fills it and shrinks the reservation to the blob's real size.
        try:
            reservation = self.host_pool.reserve(bound)
        except PreemptionHandlerOOM as err:
            return err.reason

        def work() -> SlotHandle | None:
            failure = self._store(make_parts, segment, into=reservation)
            return None if failure else segment.handle  # lost: the restore recomputes

        segment.handle = worker.submit(work)
        return None

    def _reserve_modelled(self, segment: _Segment) -> str | None:
        segment.nbytes_raw = self._raw_bytes(segment.num_tokens)
        # Stored share of the raw bytes: the plan's for mixed (0 for an all-DROP plan).
        share = (
            self.mixed_ratio if segment.codec == "mixed" else 1 / self.config.modelled_ratio[segment.codec]
        )
        try:
            segment.handle = self.host_pool.reserve(int(segment.nbytes_raw * share))
        except PreemptionHandlerOOM as err:
            return err.reason
        self._count_stored(segment)
        return None

    def _model_save_time(
        self, num_tokens: int, codec: str, now: float, speculative: bool
    ) -> tuple[float, float]:
        """(copy end, host copy ready) of a save starting at `now`. Demand saves have
        priority on the device-to-host link (as on a dedicated high-priority stream):
        they queue only behind each other; speculative copies go when it is free."""
        device_s, copy_bytes = self._modelled_device_side(num_tokens, codec)
        # One duplex link: a copy-out while a restore still streams in shares the both-ways rate.
        both_ways = self._h2d_free_at > now
        duration = device_s + self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways)
        if speculative:
            start = max(now, self._d2h_free_at, self._early_d2h_free_at)
            self._early_d2h_free_at = copy_end = start + duration
        else:
            start = max(now, self._d2h_free_at)
            self._d2h_free_at = copy_end = start + duration
        return copy_end, copy_end + self._modelled_host_s(copy_bytes, codec, self.config.codec_encode_mb_s)

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
            host_s += _codec_time_s(nbytes, mb_s.get("zstd", 0.0))
        return host_s

    # ----------------------------------------------------------------- restore
    def restore(self, request: Request, now: float, record: PreemptionRecord) -> bool:
        started = time.perf_counter()
        saved = self._saved.pop(request)
        handles = [_resolve(segment.handle) for segment in saved.segments]
        prefetched = self._prefetched.pop(request, None)
        predecoded = self._predecoded.pop(request, None)
        if predecoded is not None:
            self.predecode_bytes_used += predecoded.nbytes
        if prefetched is not None and prefetched.block_ids != request.block_ids[: len(prefetched.block_ids)]:
            self._waste_prefetch(prefetched)  # cannot happen while only the prefetcher hands blocks out
            prefetched = None
        if prefetched is not None:
            ok, dropped = prefetched.ok, prefetched.dropped
            self.num_prefetch_hits += 1
            self.prefetch_bytes_used += prefetched.nbytes
        else:
            ok, dropped = self._load_saved(request, saved, handles)
            if predecoded is not None:
                self.num_prefetch_hits += 1
            elif self.early_config.prefetch:
                self.num_prefetch_misses += 1
        for handle in handles:
            if handle is not None:
                self.host_pool.free(handle)
        record.restored = ok
        if ok and any(segment.codec == "mixed" for segment in saved.segments) and self.plan_is_lossy:
            record.warmup_tokens = min(self.config.warmup_tokens, saved.num_tokens)
        if ok and dropped is not None and dropped.any():
            # The dropped heads' restored keys are zeros: masked for the rest of the request,
            # except the warm-up tokens, which are recomputed at full precision.
            masked = np.where(dropped, saved.num_tokens - record.warmup_tokens, 0)
            previous = request.kv_masked_until
            request.kv_masked_until = masked if previous is None else np.maximum(previous, masked)
        if self.is_virtual:
            if prefetched is not None:
                end = prefetched.end_s
            else:
                decoded_s = predecoded.end_s if predecoded is not None else None
                end = self._model_restore_end(saved, now, decoded_s)
            self.restore_end_s = max(self.restore_end_s, end)
            record.restore_s = max(0.0, end - now)
        else:
            record.restore_s = time.perf_counter() - started
            self.engine_thread_s += record.restore_s
        return ok

    def _load_saved(
        self, request: Request, saved: _Saved, handles: list[SlotHandle | None]
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

    def _model_restore_end(self, saved: _Saved, now: float, decoded_s: float | None = None) -> float:
        """Virtual: when a restore of `saved` started at `now` ends (decode, then the
        host-to-device copy, queued on the link); takes the link until then. With
        `decoded_s` the host decode was done ahead (it ends then) and only the copy is left."""
        if self.early_config.prefetch:
            return self._model_staged_restore_end(saved, now, decoded_s)
        ready = max([now, *(segment.ready_at_s for segment in saved.segments)])
        end = max(ready, self._h2d_free_at, decoded_s or 0.0)
        for segment in saved.segments:
            device_s, copy_bytes = self._modelled_device_side(segment.num_tokens, segment.codec)
            if decoded_s is None:
                end += self._modelled_host_s(copy_bytes, segment.codec, self.config.codec_decode_mb_s)
            both_ways = max(self._d2h_free_at, self._early_d2h_free_at) > end  # saves still copying out
            end += self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways) + device_s
        self._h2d_free_at = end
        return end

    def _model_staged_restore_end(self, saved: _Saved, now: float, decoded_s: float | None) -> float:
        """`_model_restore_end` with prefetch on: a segment whose host encode is still
        running at `now` is copied back from its raw staging bytes (on the host since its
        copy-out ended), neither waiting for the encode nor decoding; the others wait for
        their blob (or the decode done ahead) and decode as usual."""
        end = max(now, self._h2d_free_at)
        for segment in saved.segments:
            device_s, copy_bytes = self._modelled_device_side(segment.num_tokens, segment.codec)
            if segment.ready_at_s > now:  # still encoding: the raw staging copy
                end = max(end, segment.copy_end_s)
            elif decoded_s is not None:
                end = max(end, decoded_s)
            else:
                end = max(end, segment.ready_at_s)
                end += self._modelled_host_s(copy_bytes, segment.codec, self.config.codec_decode_mb_s)
            both_ways = max(self._d2h_free_at, self._early_d2h_free_at) > end  # saves still copying out
            end += self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways) + device_s
        self._h2d_free_at = end
        return end

    # ----------------------------------------------------------------- prefetch
    def is_prefetched(self, request: Request) -> bool:
        return request in self._prefetched

    def is_predecoded(self, request: Request) -> bool:
        return request in self._predecoded

    @property
    def predecode_bytes_held(self) -> int:
        return sum(p.nbytes for p in self._predecoded.values())

    def saved_bytes(self, request: Request) -> int:
        """Raw bytes of a waiting request's host copy."""
        return sum(segment.nbytes_raw for segment in self._saved[request].segments)

    def needs_decode(self, request: Request) -> bool:
        """Its host copy costs host decode time on restore (zstd, mixed+zstd)."""
        segments = self._saved[request].segments
        mb_s = self.config.codec_decode_mb_s
        return any(self._modelled_host_s(1.0, segment.codec, mb_s) > 0 for segment in segments)

    def predecode(self, request: Request, now: float) -> int:
        """Start decoding a waiting request's host copy now, ahead of its restore (no
        device blocks needed); returns the decoded bytes it will hold on the host."""
        saved = self._saved[request]
        if request in self._predecoded:
            raise ValueError(f"request {request.request_id} is already predecoded")
        lane = min(range(len(self._decode_free_at)), key=self._decode_free_at.__getitem__)
        blobs_ready = [s.ready_at_s for s in saved.segments if s.ready_at_s <= now]  # the rest: raw staging
        ready = max([now, self._decode_free_at[lane], *blobs_ready])
        end = ready
        for segment in saved.segments:
            _, copy_bytes = self._modelled_device_side(segment.num_tokens, segment.codec)
            if segment.ready_at_s <= now:  # still encoding: its raw staging bytes need no decode
                end += self._modelled_host_s(copy_bytes, segment.codec, self.config.codec_decode_mb_s)
        self._decode_free_at[lane] = end
        nbytes = sum(segment.nbytes_raw for segment in saved.segments)
        self._predecoded[request] = _Predecoded(end, nbytes)
        self.num_predecodes += 1
        self.predecode_bytes += nbytes
        return nbytes

    @property
    def prefetched_requests(self) -> list[Request]:
        return list(self._prefetched)

    @property
    def prefetch_bytes_held(self) -> int:
        return sum(p.nbytes for p in self._prefetched.values())

    def prefetch(self, request: Request, now: float) -> None:
        """Restore a waiting request's saved KV now into the blocks it already holds
        (`request.block_ids`, given by the prefetcher, covering its computed tokens), in
        the background on the virtual clock; `restore` at admission then only claims it.
        The host copy stays until then: a cancelled prefetch loses only the copy-in."""
        saved = self._saved[request]
        if request in self._prefetched:
            raise ValueError(f"request {request.request_id} is already prefetched")
        if len(request.block_ids) < blocks_needed(saved.num_tokens, self.block_size):
            raise ValueError(f"request {request.request_id}: its blocks do not cover its saved KV")
        handles = [_resolve(segment.handle) for segment in saved.segments]
        ok, dropped = self._load_saved(request, saved, handles)
        predecoded = self._predecoded.get(request)
        end = self._model_restore_end(saved, now, predecoded.end_s if predecoded is not None else None)
        nbytes = sum(segment.nbytes_raw for segment in saved.segments)
        self._prefetched[request] = _Prefetched(list(request.block_ids), ok, dropped, end, nbytes)
        self.num_prefetches += 1
        self.prefetch_bytes += nbytes

    def cancel_prefetch(self, request: Request) -> None:
        """Drop a prefetched restore (its blocks are needed elsewhere; the caller frees
        them): the host copy remains, the copy-in was wasted."""
        prefetched = self._prefetched.pop(request, None)
        if prefetched is not None:
            self._waste_prefetch(prefetched)

    def _waste_prefetch(self, prefetched: _Prefetched) -> None:
        self.prefetch_bytes_wasted += prefetched.nbytes

    @property
    def plan_is_lossy(self) -> bool:
        return self.plan is not None and self.plan.num_fp16 < self.plan.num_layers * self.plan.num_kv_heads

    @property
    def _heads_shape(self) -> tuple[int, int]:
        return (self.kv_cache.num_layers, self.kv_cache.num_kv_heads)

    def _load_segment(
        self, request: Request, handle: SlotHandle, segment: _Segment, dropped: np.ndarray
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
        self, block_ids: list[int], handle: SlotHandle, segment: _Segment, dropped: np.ndarray
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
        """Drop every host copy of an aborted request (saved or early)."""
        saved = self._saved.pop(request, None)
        if saved is not None:
            self._free_segments(saved.segments, wasted=False)
        self.cancel_prefetch(request)
        predecoded = self._predecoded.pop(request, None)
        if predecoded is not None:
            self.predecode_bytes_wasted += predecoded.nbytes
        self.discard_early(request)

    def _free_segments(self, segments: list[_Segment], wasted: bool) -> None:
        for segment in segments:
            handle = _resolve(segment.handle)
            if handle is not None:
                self.host_pool.free(handle)
            if segment.speculative:
                self.speculative_bytes -= segment.nbytes_raw
                if wasted:
                    self.early_bytes_wasted += segment.nbytes_raw
                segment.speculative = False

    def stats(self) -> dict[str, int | float]:
        return {
            "kv_saved_bytes_raw": self.bytes_raw,
            "kv_saved_bytes_stored": self.bytes_stored,
            "host_pool_peak_bytes": self.host_pool.peak_bytes_used,
            "num_early_saves": self.num_early_saves,
            "early_bytes_raw": self.early_bytes_raw,
            "early_bytes_used": self.early_bytes_used,
            "early_bytes_wasted": self.early_bytes_wasted,
            **(
                {
                    "num_prefetches": self.num_prefetches,
                    "num_prefetch_hits": self.num_prefetch_hits,
                    "num_prefetch_misses": self.num_prefetch_misses,
                    "prefetch_bytes": self.prefetch_bytes,
                    "prefetch_bytes_used": self.prefetch_bytes_used,
                    "prefetch_bytes_wasted": self.prefetch_bytes_wasted,
                    "num_predecodes": self.num_predecodes,
                    "predecode_bytes": self.predecode_bytes,
                    "predecode_bytes_used": self.predecode_bytes_used,
                    "predecode_bytes_wasted": self.predecode_bytes_wasted,
                }
                if self.early_config.prefetch
                else {}
            ),
        }

    def close(self) -> None:
        for worker in (self._worker, self._early_worker):
            if worker is not None:
                worker.shutdown(wait=True)


def _in_flight(segment: _Segment, now: float) -> bool:
    handle = segment.handle  # read once: the early worker may replace it meanwhile
    return not handle.done() if isinstance(handle, Future) else segment.ready_at_s > now


def _resolve(handle: SlotHandle | Future | None) -> SlotHandle | None:
    return handle.result() if isinstance(handle, Future) else handle


# Header and zstd framing above the payload: the header is 36 + 8 * ndim bytes; zstd adds
# 3 bytes per 128 KB block of incompressible data (ZSTD_compressBound), bounded here by
# 1/1024 of the payload.
_HEADER_SLACK = 4096


def _blob_bound(payload_nbytes: int) -> int:
    return payload_nbytes + payload_nbytes // 1024 + _HEADER_SLACK


def _codec_time_s(nbytes: float, mb_per_s: float) -> float:
    return nbytes / (mb_per_s * 1e6) if mb_per_s > 0 else 0.0
