"""The `tiny` backend: a small Llama-style decoder computing real tokens and real KV on CPU.

Owns: the architecture (token embedding; per layer RMSNorm -> attention with RoPE and
grouped-query attention -> residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm;
untied lm_head), its named presets, seeded initialisation, the paged `forward` and the
cache-free reference `forward_naive` / `generate_naive`. It never allocates the KV pool,
never samples (except the greedy reference) and never touches the global RNG.

Parameter names follow Hugging Face Llama (`layers.0.self_attn.q_proj.weight`, ...), so
a checkpoint loader has nothing to rename. The few switches real Llama/Qwen2 checkpoints
need (q/k/v, o_proj and MLP biases, tied embeddings, Llama 3 / linear RoPE scaling) are
config fields whose defaults are the plain tiny model; `preempt.model.hf` fills them from
a checkpoint's config.json. There is one decoder class, not one per family.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from preempt.model.attention import AttentionMetadata, paged_attention, write_kv

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of long-context checkpoints (HF `rope_scaling`). `linear`
    divides every frequency by `factor`; `llama3` (Llama 3.1+) divides only the low
    frequencies, smoothly blending in the band between the two wavelength thresholds."""

    rope_type: str  # one of ROPE_SCALING_TYPES
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the pretraining context

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling '{self.rope_type}'; supported: {', '.join(ROPE_SCALING_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    intermediate_size: int  # SwiGLU hidden width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Checkpoint switches (defaults: the tiny model). Biases start at zero under the seeded
    # init and draw nothing from its generator, so the weights of a seed do not move.
    attention_bias: bool = False  # q/k/v projection biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # output projection bias (Llama's attention_bias also sets it)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # e.g. rebuilt from dataclasses.asdict
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.attention_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        attn += self.o_proj_bias * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += self.mlp_bias * (2 * self.intermediate_size + self.hidden_size)
        per_layer = attn + mlp + 2 * self.hidden_size
        num_embedding_matrices = 1 if self.tie_word_embeddings else 2
        return (
            self.num_layers * per_layer + num_embedding_matrices * self.vocab_size * self.hidden_size
        ) + self.hidden_size


PRESETS: dict[str, TinyConfig] = {
    # ~0.46M parameters (0.39M without embeddings): the replay model, fast on 2 cores.
    "tiny-2l": TinyConfig(
        vocab_size=256,
        num_layers=2,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    # ~1.05M parameters: the reference LM `preempt lm train` trains. 4 layers x 4 KV heads
    # = 16 KV heads, so the design's "10% dropped" is 2 whole heads (with 2 KV heads per
    # layer it would round to 1 of 8); GQA with 2 query heads per KV head as in Llama-3.
    # ~6.8k tokens/s of training on one core.
    "lm-4l": TinyConfig(
        vocab_size=256,
        num_layers=4,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=384,
    ),
    # ~3.1M parameters: for quality studies.
    "small-4l": TinyConfig(
        vocab_size=256,
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
    ),
}


def get_preset(name: str) -> TinyConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown tiny model preset '{name}'; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


class Linear(nn.Module):
    """Linear layer whose weight is filled by TinyLM's seeded init (nn.Linear's constructor
    would draw from the global RNG); the optional bias starts at zero."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 statistics are too coarse: normalise in at least float32.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE's (D/2,) float64 inverse frequencies, scaled as a long-context checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = theta**-exponents  # (D/2,)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3 (transformers' _compute_llama3_parameters): wavelengths shorter than
    # old_len / high_freq_factor keep their frequency, longer than old_len / low_freq_factor
    # are divided by `factor`, and the band between is interpolated linearly in old_len / wavelen.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= old_len / scaling.high_freq_factor) & (
        wavelen <= old_len / scaling.low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) positions -> cos, sin of shape (T, 1, D) (half-split "rotate_half" convention)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)  # (D/2,)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # selects this layer's masked prefixes in the metadata
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, dtype, cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, dtype, cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, dtype, cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, dtype, cfg.o_proj_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(..., T, hidden) -> q (..., T, Hq, D), k and v (..., T, Hkv, D), RoPE applied (cos,
        sin (T, 1, D) broadcast over any leading batch dims)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.layer_idx)  # (T, Hq, D)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_naive(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        gates: torch.Tensor | None = None,
        masked_until: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dense causal attention written out by hand: an implementation independent of SDPA
        and of the cache, so comparing against it tests both. `gates` (Hq,) multiply each
        query head's output before o_proj (Michel et al.'s xi; differentiable).
        `masked_until` (Hkv,): a dropped head's masked prefix, as in `paged_attention`."""
        q, k, v = self.qkv(x, cos, sin)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # (T, Hq, D): slow, fine for a reference
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale  # (Hq, T, T)
        num_tokens = x.shape[0]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=x.device).tril()
        if masked_until is not None:
            pos = torch.arange(num_tokens, device=x.device)
            mu = masked_until.repeat_interleave(group)[:, None, None]  # (Hq, 1, 1)
            causal = causal & ((pos[None, None, :] >= mu) | (pos[None, :, None] < mu))  # (Hq, T, T)
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(v.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, v)  # (T, Hq, D)
        if gates is not None:
            out = out * gates.to(out.dtype)[None, :, None]
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)


class TinyLM(nn.Module):
    """Llama-style decoder. Weights are a pure function of (cfg, seed): the init draws from
    a local generator in float32 and casts, so float64 and bfloat16 models of one seed hold
    the float32 model's weights (exactly, resp. rounded). `init_weights=False` skips the
    init and leaves the parameters uninitialised, for a checkpoint loader to fill (drawing
    billions of values only to overwrite them would cost minutes on a real model)."""

    def __init__(
        self,
        cfg: TinyConfig,
        seed: int = 0,
        dtype: torch.dtype | str = torch.float32,
        *,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, self.dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, self.dtype)
        if cfg.tie_word_embeddings:
            # One Parameter under two names: named_parameters() lists it once (as
            # embed_tokens), so the init and a loader fill it once.
            self.lm_head.weight = self.embed_tokens
        if init_weights:
            self._init_weights(seed)
        self.eval()

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Variance-preserving init (std 1/sqrt(fan_in)), not the usual 0.02: with 0.02 a random
        # model is a bigram table (changing an early prompt token moved the last logits by
        # <1%, and every prompt fell into the same few cycles), so a broken attention or KV
        # cache would go unnoticed. At unit scale each attention/MLP branch adds as much as
        # the residual carries and the context visibly steers the greedy tokens.
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                continue  # RMSNorm gains stay 1
            if name.endswith(".bias"):
                continue  # biases stay 0 and draw nothing, so the weights of a seed never move
            # Embeddings: unit-RMS rows like a normalised hidden state; weights: 1/sqrt(fan_in).
            std = 1.0 if name == "embed_tokens" else 1.0 / math.sqrt(param.shape[1])
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(self.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: (..., hidden) -> (..., V)."""
        return self.lm_head(self.norm(hidden))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Checked here because an out-of-range id otherwise fails deep inside F.embedding
        # ("index out of range in self") or, on a GPU, as an asynchronous device assert. Costs
        # one reduction over the step's token ids.
        if input_ids.numel():
            low, high = (int(v) for v in torch.aminmax(input_ids))
            if low < 0 or high >= self.cfg.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is outside the model's vocabulary [0, {self.cfg.vocab_size}); "
                    "trace replays draw prompt ids from printable ASCII [32, 127), so a model "
                    "needs vocab_size >= 127 (the byte tokenizer needs 256)"
                )
        return F.embedding(input_ids, self.embed_tokens)  # (T, hidden)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype, cfg.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Flattened batch of new tokens of several sequences -> logits (B, V) at
        `meta.logits_indices`; writes the new K/V into the paged cache."""
        if len(kv_caches) != self.cfg.num_layers:
            raise ValueError(f"expected {self.cfg.num_layers} layer caches, got {len(kv_caches)}")
        hidden = self._embed(input_ids)  # (T, hidden)
        cos, sin = self._rope(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), cos, sin, k_cache, v_cache, meta)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.logits(hidden.index_select(0, meta.logits_indices))  # (B, V)

    def forward_naive(
        self,
        input_ids: torch.Tensor,
        head_gates: torch.Tensor | None = None,
        masked_until: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence from position 0, full causal attention, no cache -> logits (T, V).
        `head_gates` (L, Hq): per-head output gates (1 = normal, 0 = masked), e.g. for
        gradient head importance. `masked_until` (L, Hkv): dropped heads' masked prefixes."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        hidden = self._embed(input_ids)  # (T, hidden)
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            gates = None if head_gates is None else head_gates[i]
            masked = None if masked_until is None else masked_until[i]
            hidden = hidden + layer.self_attn.forward_naive(
                layer.input_layernorm(hidden), cos, sin, gates, masked
            )
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.logits(hidden)


@torch.inference_mode()
def generate_naive(
    model: TinyLM,
    prompt_ids: list[int],
    num_tokens: int,
    head_gates: torch.Tensor | None = None,
    masked_until: torch.Tensor | None = None,
) -> list[int]:
    """Greedy decoding re-running `forward_naive` on the whole context for every token:
    the correctness reference for the paged runner (quadratic, slow by design)."""
    context = list(prompt_ids)
    out: list[int] = []
    for _ in range(num_tokens):
        logits = model.forward_naive(
            torch.tensor(context, dtype=torch.int64), head_gates, masked_until
        )  # (T, V)
        token = int(torch.argmax(logits[-1]))
        out.append(token)
        context.append(token)
    return out
