"""The vLLM side of preempt's KV connector: its settings and its view of vLLM's paged KV.

Owns: the connector's settings (`ConnectorSettings`), the codec they name, built from the
registry and sized to the served model (`make_store_codec`), the patch that keeps lossy
copies out of vLLM's prefix cache (`never_cache`), and the view of vLLM's per-layer KV
cache tensors as one request's KV in preempt's logical layout (`PagedKV`: a
`preempt.kv.codec.PagedCache`). The saved copies themselves are preempt's own
(`preempt.kv.store.CopiesById` over a `HostStore`: one preallocated host pool, blobs in
preempt's format, an encode worker), as the engine's are. Never imports vLLM: the
connector (`connector.py`) calls it with tensors and block ids, and it is tested in
preempt's own environment.

Codecs (`ConnectorSettings.codec`): any registered codec (`preempt.core.registry.CODECS`):
`raw`, `zstd`, `lz4` (lossless), `fp8` (every KV head float8 E4M3 with one scale per head
and K/V) and `mixed` (FP16 / FP8 per head by a plan: `random` or a plan file from
`preempt importance`). Copies are whole blocks (`PagedKV`): a resumed request recomputes
its last, partial block. A quantizing codec runs where the KV lives
(`preempt.kernels.quantize_heads`: the Triton kernel on CUDA, its torch reference on
CPU); only packed bytes reach the pool.

Dropped heads. preempt's own engine masks a dropped head's restored prefix in attention;
vLLM's attention kernels have no per-head mask, so a dropped head would come back as zero
keys that still take softmax weight. A plan's DROP heads are therefore kept as FP8 here
(said once in the log); the `mixed` plan's other classes are used as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from preempt.core.registry import CODECS
from preempt.core.sizes import parse_size
from preempt.integrations.vllm.settings import validate_settings
from preempt.kv.codec import Codec, CorruptBlobError
from preempt.kv.host_pool import HostPool
from preempt.kv.store import CopiesById, HostStore

SETTINGS_KEY = "preempt"  # kv_connector_extra_config's key for the settings
CONNECTOR_MODULE = "preempt.integrations.vllm.connector"
CONNECTOR_CLS = "PreemptKVConnector"
"""What `--kv-transfer-config` names (strings: vLLM imports the connector itself)."""


class ConnectorSettingsError(ValueError):
    """Connector settings that cannot be used; the message names the field."""


class ConnectorSettings(BaseModel):
    """`--kv-transfer-config '{"kv_connector_extra_config": {"preempt": {...}}}'`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: str = "raw"
    """How a saved copy is stored, a codec of `preempt.core.registry.CODECS`: `raw`, `zstd`
    and `lz4` lossless; `fp8` and `mixed` lossy (never served to another request through
    vLLM's prefix cache)."""
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
    loads: Literal["async", "sync"] = "async"
    """How a resumed request's copy is loaded. `async` (vLLM's load-ready protocol): vLLM
    allocates its blocks and parks it (WAITING_FOR_REMOTE_KVS) while a load thread decodes
    the copy during the next forward passes, and admits it once `get_finished` reports the
    load; no step waits for a decode. `sync`: decoded in `start_load_kv`, before the forward
    pass of the step that resumes it (the step waits; the request runs in that step)."""
    early: bool = False
    """Start copies of the requests the projection names as the next victims, a step or
    more before vLLM preempts them; at the preemption only the tokens since are copied."""
    early_horizon_steps: int = Field(8, ge=1)
    """How far ahead (decode steps) the projection looks for a block shortage."""

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value not in CODECS.names():
            raise ValueError(f"unknown codec {value!r}; choose one of {CODECS.names()}")
        return value

    @field_validator("host_pool", "slot_size")
    @classmethod
    def _size(cls, value: str) -> str:
        if parse_size(value) <= 0:
            raise ValueError(f"must be a positive size, got {value!r}")
        return value

    @property
    def lossless(self) -> bool:
        return CODECS.resolve(self.codec).is_lossless


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
        "kv_connector_extra_config": {SETTINGS_KEY: dict(settings or {})},
    }


def parse_connector_settings(data: object) -> ConnectorSettings:
    where = "preempt connector settings (kv_connector_extra_config.preempt)"
    return validate_settings(ConnectorSettings, data, ConnectorSettingsError, where)


def check_transfer_config(transfer) -> ConnectorSettings:
    """The connector's settings from vLLM's `KVTransferConfig`, which must also ask for a
    failed load to be recomputed; ConnectorSettingsError naming what is wrong. The
    connector calls it in the engine core, the plugin (plugin.py) before it starts."""
    if transfer.kv_load_failure_policy != "recompute":
        raise ConnectorSettingsError(
            'preempt\'s connector needs "kv_load_failure_policy": "recompute" in --kv-transfer-config: '
            "a copy that fails to load must be recomputed, not fail its request"
        )
    return parse_connector_settings((transfer.kv_connector_extra_config or {}).get(SETTINGS_KEY))


def make_store_codec(settings: ConnectorSettings, num_layers: int, num_kv_heads: int, log=None) -> Codec:
    """The codec a store encodes with, sized to the served model (a head plan's shape)."""
    from preempt.kernels.plan import HeadClass

    options = (
        {"plan": settings.head_plan, "fp8_share": settings.fp8_share, "drop_share": 0.0}
        if settings.codec == "mixed"
        else {}
    )
    try:
        codec = CODECS.resolve(settings.codec).build(options, num_layers, num_kv_heads)
        codec.check_shape(num_layers, num_kv_heads)
    except ValueError as err:
        raise ConnectorSettingsError(f"codec {settings.codec!r}: {err}") from None
    plan = getattr(codec, "plan", None)
    if plan is None:
        return codec
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
        codec.plan = plan.with_classes(codes, f"{plan.source or settings.head_plan} (DROP as FP8)")
    return codec


def host_copies(settings: ConnectorSettings, codec: Codec, pin_memory: bool | None = None) -> CopiesById:
    """The connector's saved copies: one preallocated host pool of `settings.host_pool`,
    blobs of `codec`, one encode worker."""
    pool = HostPool(settings.host_pool, settings.slot_size, pin_memory=pin_memory)
    return CopiesById(HostStore(pool, {settings.codec: codec}), settings.codec)


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

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        """Write `kv` (L, 2, num_tokens, H, D) as tokens `[start, start + num_tokens)` of the
        request whose block table is `block_ids`."""
        if (
            kv.ndim != 5
            or kv.shape[0] != self.num_layers
            or kv.shape[3:] != (self.num_kv_heads, self.head_dim)
        ):
            raise CorruptBlobError(
                f"saved KV of shape {tuple(kv.shape)} does not fit this model's cache "
                f"({self.num_layers} layers, {self.num_kv_heads} KV heads of {self.head_dim})"
            )
        if kv.shape[2] != num_tokens:
            raise CorruptBlobError(f"saved KV of {kv.shape[2]} tokens where {num_tokens} were stored")
        blocks, offsets = self._slots(block_ids, start, num_tokens)
        kv = kv.to(self.device, self.dtype)
        for layer, (k, v) in enumerate(self.layers):
            k[blocks, offsets] = kv[layer, 0]
            v[blocks, offsets] = kv[layer, 1]

    def raw_nbytes(self, num_tokens: int) -> int:
        return self.num_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def gather_quantized(self, block_ids: Sequence[int], start: int, num_tokens: int, plan):
        """Gather, then quantize by `plan` where the cache lives (Triton on CUDA)."""
        from preempt.kernels.quantize_heads import quantize_heads

        return quantize_heads(self.gather(block_ids, start, num_tokens), plan)

    def scatter_quantized(self, quantized, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        """Dequantize on the cache's device, then scatter (the plans here drop no head)."""
        from preempt.kernels.restore_blocks import dequantize_heads_ref

        self.scatter(dequantize_heads_ref(quantized.to(self.device)), block_ids, start, num_tokens)
