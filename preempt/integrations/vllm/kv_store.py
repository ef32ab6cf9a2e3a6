"""The acting half of preempt's KV connector for vLLM: paged KV <-> preempt's host pool.

Owns: the view of vLLM's per-layer KV cache tensors as one request's KV in preempt's
logical layout (`PagedKV`: gather a request's blocks into `(L, 2, T, H, D)`, scatter a
decoded tensor into new blocks), and the saved copies (`HostKVStore`: one preallocated
`preempt.kv.host_pool.HostPool`, blobs in preempt's own format through preempt's codecs,
a request's copy as one or more token segments). Never imports vLLM: the connector
(`connector.py`) calls it with tensors and block ids, and it is tested in preempt's own
environment.

Codecs (`ConnectorSettings.codec`): `raw` (lossless), `zstd` (lossless, byte-shuffled),
`fp8` (every KV head float8 E4M3 with one scale per head and K/V) and `mixed` (FP16 /
FP8 per head by a plan: `random` or a plan file from `preempt importance`). Copies are
whole blocks (`PagedKV`): a resumed request recomputes its last, partial block. The
quantization runs where the KV lives (`preempt.kernels.quantize_heads`: the Triton
kernel on CUDA, its torch reference on CPU); only packed bytes reach the pool.

Dropped heads. preempt's own engine masks a dropped head's restored prefix in attention;
vLLM's attention kernels have no per-head mask, so a dropped head would come back as zero
keys that still take softmax weight. A plan's DROP heads are therefore kept as FP8 here
(said once in the log); the `mixed` plan's other classes are used as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from preempt.core.sizes import parse_size
from preempt.integrations.vllm.settings import validate_settings
from preempt.kv.codec import Codec, CorruptBlobError, MixedCodec, make_codec
from preempt.kv.host_pool import HostPool, HostPoolError, PreemptionHandlerOOM, SlotHandle

LOSSLESS = ("raw", "zstd")
CONNECTOR_MODULE = "preempt.integrations.vllm.connector"
CONNECTOR_CLS = "PreemptKVConnector"
"""What `--kv-transfer-config` names (strings: vLLM imports the connector itself)."""


class ConnectorSettingsError(ValueError):
    """Connector settings that cannot be used; the message names the field."""


class ConnectorSettings(BaseModel):
    """`--kv-transfer-config '{"kv_connector_extra_config": {"preempt": {...}}}'`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: Literal["raw", "zstd", "fp8", "mixed"] = "raw"
    """How a saved copy is stored: `raw`/`zstd` lossless; `fp8`/`mixed` lossy (never
    served to another request through vLLM's prefix cache)."""
    head_plan: str = "random"
    """`mixed`: `random` (seeded, `fp8_share` of the heads FP8) or a JSON plan file."""
    fp8_share: float = Field(0.5, ge=0, le=1)
    """`mixed` with the `random` plan: the share of (layer, KV head) pairs stored FP8."""
    host_pool: str = "1GiB"
    """The host pool, preallocated once (a size: `512MiB`, `2GB`, or bytes)."""
    slot_size: str = "256MiB"
    """The largest one copy may be; a larger one falls back to recompute."""
    saves: Literal["all", "cost", "none"] = "all"
    """Whom to save: every victim, or (`cost`) a victim only when saving and loading its
    KV is expected to take less time than recomputing it (InferCept's rule: measured
    copy seconds per token against measured prefill seconds per token), or `none`: the
    connector only counts what the preemptions drop (vLLM's recompute, measured)."""
    early: bool = False
    """Start copies of the requests the projection names as the next victims, a step or
    more before vLLM preempts them; at the preemption only the tokens since are copied."""
    early_horizon_steps: int = Field(8, ge=1)
    """How far ahead (decode steps) the projection looks for a block shortage."""

    @field_validator("host_pool", "slot_size")
    @classmethod
    def _size(cls, value: str) -> str:
        if parse_size(value) <= 0:
            raise ValueError(f"must be a positive size, got {value!r}")
        return value

    @property
    def lossless(self) -> bool:
        return self.codec in LOSSLESS


def kv_transfer_config(settings: Mapping | None = None, module_path: str = CONNECTOR_MODULE,
                       connector: str = CONNECTOR_CLS) -> dict:  # fmt: skip
    """vLLM's `--kv-transfer-config` (or `LLM(kv_transfer_config=...)`) for the connector
    with `settings` (`ConnectorSettings` fields). `kv_role` `kv_both`: it saves and loads;
    `kv_load_failure_policy` `recompute`: a copy that fails to load is recomputed."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module_path,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"preempt": dict(settings or {})},
    }


def parse_connector_settings(data: object) -> ConnectorSettings:
    where = "preempt connector settings (kv_connector_extra_config.preempt)"
    return validate_settings(ConnectorSettings, data, ConnectorSettingsError, where)


def make_store_codec(settings: ConnectorSettings, num_layers: int, num_kv_heads: int, log=None) -> Codec:
    """The codec a store encodes with; `mixed`'s plan sized to the served model."""
    from preempt.kernels.plan import HeadClass, HeadPlan

    if settings.codec in LOSSLESS:
        return make_codec(settings.codec)
    if settings.codec == "fp8":
        return MixedCodec(plan=HeadPlan.all_fp8(num_layers, num_kv_heads))
    if settings.head_plan == "random":
        plan = HeadPlan.random(num_layers, num_kv_heads, fp8_share=settings.fp8_share, drop_share=0.0, seed=0)
    else:
        plan = HeadPlan.load(settings.head_plan)
        plan.check_shape(num_layers, num_kv_heads)
    codes = plan.codes()
    other = set(codes.reshape(-1).tolist()) - {int(HeadClass.FP16), int(HeadClass.FP8), int(HeadClass.DROP)}
    if other:
        raise ConnectorSettingsError(
            f"head_plan {settings.head_plan!r}: classes {sorted(HeadClass(c).name for c in other)} "
            "quantize per "
            "channel, which depends on the cache's order inside a block; the connector takes FP16/FP8 plans"
        )
    if (codes == int(HeadClass.DROP)).any():
        if log is not None:
            log(
                f"preempt connector: {int((codes == int(HeadClass.DROP)).sum())} DROP heads of plan "
                f"{plan.source or settings.head_plan!r} kept as FP8 (vLLM's attention has no per-head mask)"
            )
        codes = codes.copy()
        codes[codes == int(HeadClass.DROP)] = int(HeadClass.FP8)
        plan = plan.with_classes(codes, f"{plan.source or settings.head_plan} (DROP as FP8)")
    return MixedCodec(plan=plan)


def never_cache(coordinator, request_ids: set[str]) -> None:
    """Keep vLLM's prefix cache from taking any block of the requests in `request_ids`
    (a live set): `coordinator.cache_blocks(request, ...)` does nothing for them. A lossy
    copy's blocks would enter the cache under the original tokens' hashes and be served
    to the next request with that prefix; so would every block computed after it (its
    attention read the lossy prefix)."""
    cache_blocks = coordinator.cache_blocks

    def cache_unless_listed(request, *args, **kwargs):
        if request.request_id not in request_ids:
            cache_blocks(request, *args, **kwargs)

    coordinator.cache_blocks = cache_unless_listed


class PagedKV:
    """vLLM's per-layer KV cache tensors as one request's KV in preempt's layout, whole
    blocks at a time.

    Each layer's tensor is seen as K and V views of shape `(num_blocks, block_size, H, D)`,
    whichever of the layouts vLLM's attention backends allocate it is:
    - CPU attention: `(num_blocks, H, block_size, 2 * D)`: per (block, head) a K area then
      a V area of `block_size * D` values each. Inside the K area the kernel's own order
      holds (the `vec` ISA stores it dim-major, `(D, block_size)`), so a "token" row of
      the view is one only for V;
    - FlashAttention / Triton: `(2, num_blocks, block_size, H, D)`;
    - FlashInfer: `(num_blocks, 2, block_size, H, D)`.
    The connector therefore moves whole blocks only (`start` and `end` multiples of the
    block size): a block's K and V areas per head go out and come back byte for byte,
    whatever their inner order, and FP8's one scale per (layer, head, K or V) does not
    depend on it either. Views share the cache's memory: a scatter writes into vLLM's
    blocks.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layers = [self._views(t, num_blocks, block_size, num_kv_heads, head_dim) for t in kv_caches]
        self.dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device

    @staticmethod
    def _views(t: torch.Tensor, nb: int, bs: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = tuple(t.shape)
        if shape == (nb, h, bs, 2 * d):
            split = t.view(nb, h, 2, bs, d)
            return split[:, :, 0].permute(0, 2, 1, 3), split[:, :, 1].permute(0, 2, 1, 3)
        if shape == (2, nb, bs, h, d):
            return t[0], t[1]
        if shape == (nb, 2, bs, h, d):
            return t[:, 0], t[:, 1]
        raise ValueError(
            f"KV cache tensor of shape {shape}: not a layout preempt's connector knows "
            f"({nb} blocks of {bs} tokens, {h} KV heads of {d}): CPU (nb, H, bs, 2D), "
            "FlashAttention (2, nb, bs, H, D) or FlashInfer (nb, 2, bs, H, D)"
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _slots(
        self, block_ids: Sequence[int], start: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if start % self.block_size or num_tokens % self.block_size:
            raise ValueError(
                f"tokens [{start}, {start + num_tokens}): the connector moves whole blocks "
                f"of {self.block_size}"
            )
        positions = torch.arange(start, start + num_tokens)
        table = torch.as_tensor(list(block_ids), dtype=torch.long)
        blocks = table[positions // self.block_size].to(self.device)
        return blocks, (positions % self.block_size).to(self.device)

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """Tokens `[start, start + num_tokens)` (whole blocks) of the request whose blocks
        are `block_ids` (its whole block table, in order), as a new `(L, 2, T, H, D)` tensor on the cache's
        device: a copy, so vLLM may reuse the blocks once this returns."""
        blocks, offsets = self._slots(block_ids, start, num_tokens)
        out = torch.empty(
            (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        for layer, (k, v) in enumerate(self.layers):
            out[layer, 0] = k[blocks, offsets]
            out[layer, 1] = v[blocks, offsets]
        return out

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        """Write `kv` (L, 2, T, H, D) as tokens `[start, start + T)` of the request whose
        block table is `block_ids`."""
        if kv.shape[0] != self.num_layers or kv.shape[3:] != (self.num_kv_heads, self.head_dim):
            raise CorruptBlobError(
                f"saved KV of shape {tuple(kv.shape)} does not fit this model's cache "
                f"({self.num_layers} layers, {self.num_kv_heads} KV heads of {self.head_dim})"
            )
        blocks, offsets = self._slots(block_ids, start, kv.shape[2])
        kv = kv.to(self.device, self.dtype)
        for layer, (k, v) in enumerate(self.layers):
            k[blocks, offsets] = kv[layer, 0]
            v[blocks, offsets] = kv[layer, 1]


@dataclass
class Segment:
    """Tokens `[start, end)` of one request, stored as one blob."""

    start: int
    end: int
    handle: SlotHandle | None = None  # None while its encode runs
    raw_bytes: int = 0
    error: str | None = None  # why it could not be stored ("pool_full", "slot_too_small", ...)


@dataclass
class CopyReport:
    """What one finished store or load did and cost (the worker reports it to the
    connector's scheduler side); `error` names why it failed, None when it did not."""

    num_tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class SavedCopy:
    segments: list[Segment] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.segments[-1].end if self.segments else 0


class HostKVStore:
    """Saved copies of requests' KV in one preallocated host pool, by request id.

    `save` copies a request's tokens `[start, end)` out of the paged cache (`PagedKV.gather`,
    on the calling thread: vLLM may reuse the blocks once it returns), then encodes and
    stores them on a worker thread, so the compression overlaps the next forward pass.
    `load` decodes every segment of a copy into the request's new blocks and frees it. A
    segment that cannot be stored or decoded fails the whole copy: nothing partial is
    ever loaded.
    """

    def __init__(self, settings: ConnectorSettings, codec: Codec, pin_memory: bool | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self.pool = HostPool(settings.host_pool, settings.slot_size, pin_memory=pin_memory)
        self.copies: dict[str, SavedCopy] = {}
        self._lock = threading.Lock()
        self._work = _Worker()

    # ------------------------------------------------------------- saving
    def save(
        self, request_id: str, paged: PagedKV, block_ids: Sequence[int], start: int, end: int
    ) -> Segment:
        """Start storing tokens `[start, end)` as the next segment of `request_id`'s copy
        (`start` must be where the copy ends). Returns the segment; its handle is set (or
        its error) when `pending(request_id)` is False."""
        began = time.perf_counter()
        with self._lock:
            copy = self.copies.setdefault(request_id, SavedCopy())
            if copy.num_tokens != start:
                raise ValueError(
                    f"request {request_id}: copy holds {copy.num_tokens} tokens, segment starts at {start}"
                )
            segment = Segment(start, end)
            copy.segments.append(segment)
        kv = paged.gather(block_ids, start, end - start)
        segment.raw_bytes = kv.numel() * kv.element_size()
        self._work.submit(request_id, lambda: self._store(segment, kv, began))
        return segment

    def _store(self, segment: Segment, kv: torch.Tensor, began: float) -> float:
        try:
            segment.handle = self.pool.store(self._encode(kv))
        except PreemptionHandlerOOM as err:
            segment.error = err.reason
        except HostPoolError:
            segment.error = "closed"
        except Exception as err:  # an encode that fails must fail this copy, not the worker thread
            segment.error = f"encode: {type(err).__name__}: {err}"
        return time.perf_counter() - began

    def _encode(self, kv: torch.Tensor) -> list:
        if isinstance(self.codec, MixedCodec):
            from preempt.kernels.quantize_heads import quantize_heads

            return self.codec.encode_quantized(quantize_heads(kv, self.codec.plan).to("cpu"))
        return self.codec.encode_parts(kv.cpu())

    def touch(self, request_id: str) -> None:
        """Report this copy as finished once its segments in flight are (a victim whose
        early copy already holds every token has nothing more to store)."""
        self._work.submit(request_id, lambda: 0.0)

    def pending(self, request_id: str) -> bool:
        """A segment of this request's copy is still being encoded."""
        return self._work.pending(request_id)

    def wait(self, request_id: str) -> None:
        self._work.wait(request_id)

    def finished(self) -> dict[str, float]:
        """Request id -> seconds of its slowest store, for the copies whose stores have
        all finished since the last call."""
        return self._work.drain()

    def stored(self, request_id: str) -> tuple[int, str | None]:
        """(tokens held, the failure if any segment failed) for a copy no longer pending."""
        copy = self.copies.get(request_id)
        if copy is None:
            return 0, "missing"
        error = next((s.error for s in copy.segments if s.error is not None), None)
        return copy.num_tokens, error

    def nbytes(self, request_id: str) -> tuple[int, int]:
        """(raw bytes, stored bytes) of a copy."""
        copy = self.copies.get(request_id)
        segments = copy.segments if copy else []
        return sum(s.raw_bytes for s in segments), sum(s.handle.nbytes for s in segments if s.handle)

    # ------------------------------------------------------------- loading
    def load(
        self, request_id: str, paged: PagedKV, block_ids: Sequence[int], start: int, end: int
    ) -> CopyReport:
        """Decode tokens `[start, end)` of the copy into the request's blocks, then free the
        copy. Raises CorruptBlobError (a failed checksum, a missing or short copy); the copy
        is freed either way."""
        began = time.perf_counter()
        self.wait(request_id)
        copy = self.copies.get(request_id)
        try:
            if copy is None or copy.num_tokens < end or any(s.handle is None for s in copy.segments):
                raise CorruptBlobError(f"request {request_id}: no complete saved copy of {end} tokens")
            report = CopyReport(num_tokens=end - start)
            for segment in copy.segments:
                lo, hi = max(segment.start, start), min(segment.end, end)
                if lo >= hi:
                    continue
                kv = self._decode(self.pool.load(segment.handle), paged.device)
                if kv.shape[2] != segment.end - segment.start:
                    raise CorruptBlobError(
                        f"request {request_id}: segment of {segment.end - segment.start} tokens "
                        f"decoded to {kv.shape[2]}"
                    )
                paged.scatter(kv[:, :, lo - segment.start : hi - segment.start], block_ids, lo)
                report.raw_bytes += kv.numel() * kv.element_size()
                report.stored_bytes += segment.handle.nbytes
            report.seconds = time.perf_counter() - began
            return report
        finally:
            self.discard(request_id)

    def _decode(self, blob, device: torch.device) -> torch.Tensor:
        if isinstance(self.codec, MixedCodec):
            from preempt.kernels.restore_blocks import dequantize_heads_ref

            return dequantize_heads_ref(self.codec.decode_quantized(blob).to(device))
        return self.codec.decode(blob).to(device)

    def discard(self, request_id: str) -> None:
        """Free a request's copy (waiting for a store in flight first)."""
        self.wait(request_id)
        with self._lock:
            copy = self.copies.pop(request_id, None)
        for segment in copy.segments if copy else ():
            if segment.handle is not None:
                self.pool.free(segment.handle)

    def close(self) -> None:
        self._work.close()
        for request_id in list(self.copies):
            self.discard(request_id)
        self.pool.close()


class _Worker:
    """One encode thread, tasks by request id, in submission order."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="preempt-kv-save")
        self._futures: dict[str, list] = {}
        self._lock = threading.Lock()

    def submit(self, request_id: str, task) -> None:
        future = self._pool.submit(task)
        with self._lock:
            self._futures.setdefault(request_id, []).append(future)

    def pending(self, request_id: str) -> bool:
        with self._lock:
            return any(not f.done() for f in self._futures.get(request_id, ()))

    def wait(self, request_id: str) -> None:
        with self._lock:
            futures = list(self._futures.get(request_id, ()))
        for future in futures:
            future.result()

    def drain(self) -> dict[str, float]:
        """Request id -> the longest of its tasks, for requests whose tasks are all done
        (reported once)."""
        out = {}
        with self._lock:
            for request_id, futures in list(self._futures.items()):
                if all(f.done() for f in futures):
                    out[request_id] = max(f.result() for f in futures)
                    del self._futures[request_id]
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
