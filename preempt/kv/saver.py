"""Moves preempted requests' KV to host memory and back: the `KVMover` the scheduler calls.

Owns: the host copies of preempted requests (`SavedCopy`: this saver is their only
owner, from the save until the restore or a discard) and the moves' results: `save`
returns a `SaveResult` (bytes copied, time, and a future of the stored bytes, which on
the wall clock a worker thread learns later) and `restore` a `RestoreResult`; the
scheduler writes them into its own `PreemptionRecord`. Whom to save, restore or prefetch
is decided elsewhere (the scheduler, early saves, the prefetcher).

Composed of one part per concern, each owning its state:
- `preempt.kv.blobs.BlobStore`: the engine's side of the host store (preempt.kv.store:
  a segment into one host-pool blob and back): its codecs, KV cache and worker threads;
- `preempt.kv.timing.VirtualTiming`: what each move costs on the virtual clock (the
  PCIe link, host codec, device packing) and when copied-out blocks are free again;
- `preempt.kv.speculative`: early copies of running requests and restores started
  before admission, with their used / wasted / held accounting.

Clocks. On the virtual clock data still moves for real on the `tiny` backend (bit-exact
round trips are tested), but instantly in virtual time. On the wall clock, the gather
runs on the engine thread and encode + store on a worker thread, so compression overlaps
the next steps.

Mixed precision (`swap_mixed`). The save quantizes on the device, fused with the block
gather, so only the packed bytes cross PCIe; the restore dequantizes into the new blocks,
marks the plan's dropped heads on the request (attention masks their restored prefix for
the rest of its life) and returns `warmup_tokens` for the scheduler to recompute at full
precision.
"""

from __future__ import annotations

import time

import numpy as np

from preempt.core.block_pool import blocks_needed
from preempt.core.config import EngineConfig
from preempt.core.cost_model import CostModel
from preempt.core.registry import save_codec
from preempt.core.request import Request
from preempt.kv.blobs import BlobStore
from preempt.kv.host_pool import HostPool
from preempt.kv.kv_cache import KVCache
from preempt.kv.record import KVMover, RestoreResult, SaveResult
from preempt.kv.speculative import EarlyCopies, Predecoded, Prefetched, RestoresAhead
from preempt.kv.store import SavedCopy, Segment, gather_stored
from preempt.kv.timing import VirtualTiming


class Saver(KVMover):
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None, cost_model: CostModel, block_size: int
    ):
        self.config = config.preemption
        self.early_config = config.early_save
        self.block_size = block_size
        self.is_virtual = config.clock.kind == "virtual"
        self.blobs = BlobStore(config, kv_cache, cost_model, block_size)
        self.timing = VirtualTiming(
            cost_model,
            self.blobs.codecs,
            {name: c.encode_mb_s for name, c in self.blobs.calibration.items()},
            {name: c.decode_mb_s for name, c in self.blobs.calibration.items()},
            staged_restores=config.early_save.prefetch,
            num_decode_lanes=config.early_save.prefetch_decode_threads,
        )
        # Keyed by the request object (identity, and a live reference: an id() could be
        # reused by a new request once an old one is garbage-collected).
        self._saved: dict[Request, SavedCopy] = {}  # host copy of a preempted request
        self.early = EarlyCopies()  # early segments of running requests
        self.ahead = RestoresAhead()  # restore prefetch (preempt.early.prefetch)
        self.bytes_raw = 0
        self.engine_thread_s = 0.0  # wall clock: time the engine thread spent saving/restoring
        self.early_thread_s = 0.0  # wall clock: the engine thread's share of early saves

    # ----------------------------------------------------------------- parts
    @property
    def host_pool(self) -> HostPool:
        return self.blobs.host_pool

    @property
    def plan(self):
        """The head plan of the codec the mode saves with (`swap_mixed`'s), else None."""
        return getattr(
            self.blobs.codecs[save_codec(self.config.mode, self.config.reclaim_codec)], "plan", None
        )

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
        if self.is_virtual:
            save_s = max([now, *(segment.ready_at_s for segment in segments)]) - now
        else:
            save_s = time.perf_counter() - started  # the engine thread's share
            self.engine_thread_s += save_s
        self._saved[request] = SavedCopy(segments)
        self.bytes_raw += tail.nbytes_raw
        return SaveResult(
            None,
            bytes_raw=tail.nbytes_raw,
            bytes_early=sum(segment.nbytes_raw for segment in early),
            save_s=save_s,
            # The victim's blocks are reusable once its own copies are out (not anyone else's).
            copy_end_s=max([0.0, *(segment.copy_end_s for segment in segments)]),
            bytes_stored=gather_stored(segments),
        )

    def early_save(self, request: Request, now: float) -> bool:
        """Copy the request's full blocks not yet on the host, speculatively, while it keeps
        running. False (nothing done) when there is nothing new, the speculation budget or
        the in-flight bound is reached, or the host pool has no slot to spare."""
        started = time.perf_counter()
        covered = self.early.covered(request)
        end = request.num_computed_tokens // self.block_size * self.block_size  # full blocks only
        if end <= covered:
            return False  # nothing new: not a refusal
        if not self._early_allowed(end - covered, now):
            self.early.num_refused += 1
            return False
        codec = save_codec(self.config.mode, self.config.reclaim_codec)
        segment = self._save_segment(request, covered, end, codec, now, speculative=True)
        if isinstance(segment, str):
            self.early.num_refused += 1
            return False
        self.early.add(request, segment)
        self.bytes_raw += segment.nbytes_raw
        if not self.is_virtual:
            self.early_thread_s += time.perf_counter() - started
        return True

    def discard_early(self, request: Request) -> None:
        """The request finished (or left the batch for good): its early copies were wasted."""
        self._free_segments(self.early.take(request), wasted=True)

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
        return self.blobs.raw_bytes(num_tokens)

    def _save_segment(
        self, request: Request, start: int, end: int, codec: str, now: float, speculative: bool
    ) -> Segment | str:
        """Save tokens [start, end) (start block-aligned) into one host blob, for a
        preemption or speculatively. The failure reason if it cannot be kept."""
        segment = Segment(start, end - start, codec, ready_at_s=now, speculative=speculative)
        if end == start:
            segment.stored.set_result(0)
            return segment
        failure = self.blobs.store_segment(request, segment, speculative)
        if failure is not None:
            return failure
        if self.is_virtual:
            segment.copy_end_s, segment.ready_at_s = self.timing.save(
                segment.num_tokens, codec, now, speculative
            )
        return segment

    # ----------------------------------------------------------------- restore
    def restore(self, request: Request, now: float, *, background: bool = False) -> RestoreResult:
        started = time.perf_counter()
        saved = self._saved.pop(request)
        prefetched, predecoded = self.ahead.claim(request, now)
        if prefetched is not None:
            ok, dropped = prefetched.ok, prefetched.dropped
        else:
            ok, dropped = self.blobs.load(request, saved)
            if predecoded is None and self.early_config.prefetch:
                self.ahead.num_prefetch_misses += 1
        for segment in saved.segments:
            self.blobs.free(segment)
        warmup_tokens = 0
        if ok and any(self.blobs.codecs[segment.codec].loses_precision for segment in saved.segments):
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
            if not background:  # compute waits for it (Engine._stall reads restore_end_s)
                self.timing.restored(end)
            restore_s = max(0.0, end - now)
        else:
            restore_s = time.perf_counter() - started
            self.engine_thread_s += restore_s
        return RestoreResult(ok, warmup_tokens, restore_s)

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
        ok, dropped = self.blobs.load(request, saved)
        predecoded = self.ahead.predecoded.get(request)
        end = self.timing.restore_end(saved, now, predecoded.end_s if predecoded is not None else None)
        nbytes = sum(segment.nbytes_raw for segment in saved.segments)
        self.ahead.add_prefetch(request, Prefetched(list(request.block_ids), ok, dropped, end, nbytes))

    def cancel_prefetch(self, request: Request) -> None:
        """Drop a prefetched restore (its blocks are needed elsewhere; the caller frees
        them): the host copy remains, the copy-in was wasted."""
        self.ahead.cancel(request)

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
            self.blobs.free(segment)
            self.early.freed(segment, wasted)

    def stats(self) -> dict[str, int | float]:
        early = self.early
        return {
            "kv_saved_bytes_raw": self.bytes_raw,
            "kv_saved_bytes_stored": self.blobs.bytes_stored,
            "host_pool_peak_bytes": self.host_pool.peak_bytes_used,
            "num_early_saves": early.num_early_saves,
            "early_bytes_raw": early.early_bytes_raw,
            "early_bytes_used": early.early_bytes_used,
            "early_bytes_wasted": early.early_bytes_wasted,
            **(self.ahead.stats() if self.early_config.prefetch else {}),
        }

    def close(self) -> None:
        """Stop the workers and free the host pool (the engine's `close`). Idempotent; the
        counters (`stats`) stay readable."""
        self.blobs.close()
