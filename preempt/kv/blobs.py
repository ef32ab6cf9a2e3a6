"""The engine's side of the host store: its codecs, its KV cache and its workers.

Owns: the codecs the engine saves with, built by name from the registry with the
config's options and shaped to the model (`EngineCodecs`: a codec is built when first
used; the mode's own at once, so a bad option fails at start-up); the engine's two
wall-clock workers (demand saves and early saves, so a queue of speculative work never
delays a preemption's save); and, for the `null` backend (no KV data), a blob as a
reservation of the modelled size (the target's KV times the codec's `stored_share`).
The data path itself (gather, encode, store, decode, scatter) is preempt.kv.store's.

Acting code: it never decides whom to save.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import numpy as np

from preempt.core.config import CodecCalibration, ConfigError, EngineConfig
from preempt.core.cost_model import CostModel
from preempt.core.registry import save_codec
from preempt.core.request import Request
from preempt.kv.codec import CODECS, Codec, CorruptBlobError
from preempt.kv.host_pool import HostPool
from preempt.kv.kv_cache import KVCache
from preempt.kv.store import HostStore, SavedCopy, Segment, Worker


def calibration(config: EngineConfig, name: str) -> CodecCalibration:
    """Codec `name`'s host side on the virtual clock: the config's `clock.codecs.<name>`
    over the codec's own calibration."""
    own = CODECS[name].calibration
    given = config.clock.codecs.get(name)
    return own if given is None else given.over(own)


class EngineCodecs(Mapping[str, Codec]):
    """Codec name -> the engine's instance, built on first use for a model of
    `shape` = (num_layers, num_kv_heads); `exact`: the codec must fit that shape (real KV),
    not only be priced by it (the `null` backend)."""

    def __init__(self, config: EngineConfig, shape: tuple[int, int], exact: bool) -> None:
        self._config = config.preemption
        self._seed = config.seed
        self._shape = shape
        self._exact = exact
        self._built: dict[str, Codec] = {}
        self[save_codec(self._config.mode, self._config.reclaim_codec)]  # fail now, not at a save

    def __getitem__(self, name: str) -> Codec:
        codec = self._built.get(name)
        if codec is None:
            try:
                options = self._config.codecs.get(name, {})
                codec = CODECS[name].build(options, *self._shape, seed=self._seed)
                if self._exact:
                    codec.check_shape(*self._shape)
            except ValueError as err:
                raise ConfigError(f"config key 'preemption.codecs.{name}': {err}") from None
            self._built[name] = codec
        return codec

    def __deepcopy__(self, memo: dict[int, object]) -> EngineCodecs:
        return self  # codecs hold no state between blobs: an engine fork shares them

    def __iter__(self) -> Iterator[str]:
        return iter(self._built)

    def __len__(self) -> int:
        return len(self._built)


class BlobStore:
    def __init__(
        self, config: EngineConfig, kv_cache: KVCache | None, cost_model: CostModel, block_size: int
    ) -> None:
        p = config.preemption
        # Every codec's host side on the virtual clock, once: the timing and the null
        # backend's modelled sizes read it.
        self.calibration = {name: calibration(config, name) for name in CODECS}
        target = cost_model.target
        shape = (
            (kv_cache.num_layers, kv_cache.num_kv_heads)
            if kv_cache is not None
            else (target.num_layers, target.num_kv_heads)
        )
        self.codecs = EngineCodecs(config, shape, exact=kv_cache is not None)
        self.store = HostStore(HostPool(p.host_mem, p.slot_size, allocate=kv_cache is not None), self.codecs)
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.block_size = block_size
        is_virtual = config.clock.kind == "virtual"
        self._worker = None if is_virtual else Worker("kv-saver")
        self._early_worker = None if is_virtual else Worker("kv-early")

    def __deepcopy__(self, memo: dict[int, object]) -> BlobStore:
        """A model of this store (an engine fork's, virtual clock): its pool's extents and
        byte counts copied, no KV cache (it moves no data), the codecs shared."""
        if self._worker is not None:
            raise ValueError("a blob store on the wall clock (worker threads) cannot be copied")
        copied = object.__new__(BlobStore)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name == "kv_cache":
                value = None
            elif name not in ("calibration", "cost_model"):
                value = copy.deepcopy(value, memo)
            setattr(copied, name, value)
        return copied

    @property
    def host_pool(self) -> HostPool:
        return self.store.pool

    @property
    def bytes_stored(self) -> int:
        return self.store.bytes_stored

    def raw_bytes(self, num_tokens: int) -> int:
        """Uncompressed bytes of `num_tokens` of KV as this backend holds them."""
        if self.kv_cache is None:
            return num_tokens * self.cost_model.target.kv_bytes_per_token
        return self.kv_cache.raw_nbytes(num_tokens)

    # ----------------------------------------------------------------- store
    def store_segment(self, request: Request, segment: Segment, speculative: bool) -> str | None:
        """Copy the segment's tokens out of the request's blocks into a blob (now on the
        virtual clock; the encode and store on a worker on the wall clock). The failure
        reason if the pool cannot take it; the blob's size comes through `segment.stored`."""
        if self.kv_cache is None:
            segment.nbytes_raw = self.raw_bytes(segment.num_tokens)
            share = self.codecs[segment.codec].stored_share(self.calibration[segment.codec].modelled_ratio)
            return self.store.reserve(segment, int(segment.nbytes_raw * share))
        worker = self._early_worker if speculative else self._worker
        return self.store.save(segment, self.kv_cache, request.block_ids, worker)

    # ----------------------------------------------------------------- load
    def load(self, request: Request, saved: SavedCopy) -> tuple[bool, np.ndarray | None]:
        """Write the saved segments into the request's blocks: (usable, the heads they could
        not restore (L, H), or None without KV data). Unusable: a segment not stored,
        corrupt, or not this request's KV (the caller recomputes)."""
        if self.kv_cache is None:
            return all(
                segment.error is None and segment.handle is not None for segment in saved.segments
            ), None
        dropped = np.zeros((self.kv_cache.num_layers, self.kv_cache.num_kv_heads), dtype=bool)
        for segment in saved.segments:
            try:
                lost = self.store.restore(segment, self.kv_cache, request.block_ids)
            except CorruptBlobError:
                return False, dropped
            if lost is not None:
                dropped |= lost
        return True, dropped

    # ----------------------------------------------------------------- free
    def free(self, segment: Segment) -> None:
        """Free the segment's blob (waiting for its worker if it is still storing)."""
        self.store.free(segment)

    def close(self) -> None:
        """Join the workers (every queued store finishes first), then free the host pool's
        buffer. Idempotent."""
        for worker in (self._worker, self._early_worker):
            if worker is not None:
                worker.close()
        self.store.close()
