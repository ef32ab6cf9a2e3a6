"""Gradient head importance (Michel, Levy, Neubig, NeurIPS 2019) and the head plan it
yields for the mixed-precision save (docs/design.md §9): `preempt importance --model CKPT --out P`.

Owns: the importance scores, the query-head -> KV-head reduction, the gates that mask
whole KV heads, the masking comparison that checks the scores mean something, and the
files: the plan (`preempt.kernels.plan.HeadPlan`, JSON) and its scores next to it
(`<plan stem>.scores.json`: the plan file format has no room for them).

Method. A gate xi_h = 1 multiplies each query head's attention output (`head_gates`);
I_h = mean over calibration windows w of |dL_w/dxi_h|, L the window's mean next-byte
loss. Taking |.| per window is the paper's E_x|dL/dxi|; their code takes it per
mini-batch, which lets windows whose gradients disagree in sign cancel. Scores keep
their raw scale by default: the plan ranks heads across all layers at once, and on the
reference LM (4 KV heads per layer) the paper's per-layer L2 normalisation (the design's
wording; `normalize="layer"`) forces every layer to give up weak heads: masking its 10%
"least important" cost +0.137 bits/byte against +0.066 raw (random +0.230), and its rank
correlation with masking each head alone was 0.67 against 0.83 (docs/lm.md). A KV head
scores the sum of its query heads, because a save keeps or drops K/V, which all query
heads of a group share. Calibration text is the corpus's
validation split; the comparison runs on its test split, so neither scores the text
that chose the heads.

Must never: change the model's weights, or touch the engine (it reads a checkpoint and
writes files).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from preempt.kernels.plan import HeadPlan
from preempt.lm import evaluate, next_byte_loss
from preempt.model.tiny import TinyLM

SCORES_FORMAT = "preempt-head-importance"
SCORES_VERSION = 1
NORMALIZE = ("layer", "none")


@dataclass(frozen=True)
class ImportanceConfig:
    fp8_share: float = 0.5
    """Share of KV heads (next least important after the dropped) saved as FP8."""
    drop_share: float = 0.1
    """Share of KV heads (least important) dropped; also the masking comparison's share."""
    calib_bytes: int = 65_536
    """Bytes of validation text whose gradients score the heads."""
    eval_bytes: int = 65_536
    """Bytes of test text of the masking comparison."""
    seq_len: int | None = None
    """Window length; None: the checkpoint's training seq_len (256 if it has none)."""
    batch_size: int = 16
    seed: int = 0
    """Seeds the calibration windows and the random masks."""
    num_random: int = 8
    """Distinct random masks averaged in the comparison."""
    normalize: str = "none"
    """"none": the raw mean |dL/dxi| (comparable across layers: the plan ranks globally);
    "layer": L2-normalise each layer's query-head scores (Michel et al., the design's
    wording), measured worse for a global plan (module doc)."""
    single_head: bool = False
    """Also mask each KV head alone and report its held-out cost and the rank correlation
    of the scores with those costs (L * Hkv more evaluations)."""

    def __post_init__(self) -> None:
        for name in ("calib_bytes", "eval_bytes", "batch_size", "num_random"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {self.seq_len}")
        for name in ("fp8_share", "drop_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got '{self.normalize}'")
        if self.fp8_share + self.drop_share > 1.0:
            raise ValueError(f"fp8_share + drop_share must be <= 1, got {self.fp8_share} + {self.drop_share}")


def head_importance(model: TinyLM, windows: np.ndarray | torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(N, T+1) calibration windows -> (L, Hq) float64 mean |dL_w/dxi_h| over windows
    (not normalised). One backward per batch gives every window's own gradient: each
    window has its own row of gates."""
    cfg = model.cfg
    windows = torch.as_tensor(windows, dtype=torch.int64)
    total = torch.zeros(cfg.num_layers, cfg.num_heads, dtype=torch.float64)
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        gates = torch.ones(
            batch.shape[0], cfg.num_layers, cfg.num_heads, dtype=model.dtype, requires_grad=True
        )
        losses = next_byte_loss(model, batch, gates)  # (B,): window b depends only on gates[b]
        (grad,) = torch.autograd.grad(losses.sum(), gates)
        total += grad.abs().sum(dim=0).double()
    return total / windows.shape[0]


def normalise_per_layer(scores: torch.Tensor) -> torch.Tensor:
    """(L, H) -> each layer's row divided by its L2 norm (an all-zero row stays zero)."""
    norms = scores.norm(dim=-1, keepdim=True)
    return scores / torch.where(norms > 0, norms, torch.ones_like(norms))


def kv_head_scores(query_scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(L, Hq) -> (L, Hkv): a KV head's score is the sum of its query heads' (query head h
    reads KV head h // (Hq / Hkv), as in `repeat_interleave` and `head_gates_for`)."""
    num_layers, num_heads = query_scores.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} KV heads")
    return query_scores.reshape(num_layers, num_kv_heads, num_heads // num_kv_heads).sum(dim=-1)


def gates_for_dropped(dropped: np.ndarray | torch.Tensor, num_heads: int) -> torch.Tensor:
    """(L, Hkv) bool, True = KV head masked -> (L, Hq) float32 gates: 0 on every query head
    of a masked KV head, 1 elsewhere (what a dropped head does to attention)."""
    dropped = torch.as_tensor(np.asarray(dropped), dtype=torch.bool)
    num_kv_heads = dropped.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} KV heads")
    return (~dropped).repeat_interleave(num_heads // num_kv_heads, dim=1).float()


def _mask_of(flat_heads: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    mask = np.zeros(shape[0] * shape[1], dtype=bool)
    mask[flat_heads] = True
    return mask.reshape(shape)


def _heads(mask: np.ndarray) -> list[list[int]]:
    return [[int(layer), int(head)] for layer, head in np.argwhere(mask)]


def masking_comparison(
    model: TinyLM,
    windows: np.ndarray | torch.Tensor,
    kv_scores: torch.Tensor | np.ndarray,
    num_masked: int,
    *,
    num_random: int = 8,
    seed: int = 0,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Held-out loss with `num_masked` whole KV heads masked: none, the least important
    (ties broken as `HeadPlan.from_importance` breaks them), `num_random` seeded random
    choices (mean, std, min, max) and the most important. If the scores rank heads by
    what they contribute, least << random << most."""
    scores = np.asarray(torch.as_tensor(kv_scores).cpu(), dtype=float)
    shape = scores.shape
    if not 0 < num_masked < scores.size:
        raise ValueError(f"num_masked must lie in (0, {scores.size}), got {num_masked}")
    num_heads = model.cfg.num_heads
    order = np.argsort(scores.reshape(-1), kind="stable")  # least important first

    def run(mask: np.ndarray) -> dict[str, Any]:
        held = evaluate(model, windows, gates_for_dropped(mask, num_heads).to(model.dtype), batch_size)
        return {"loss": held.loss, "bpb": held.bpb, "heads": _heads(mask)}

    base = evaluate(model, windows, None, batch_size)
    least = run(_mask_of(order[:num_masked], shape))
    most = run(_mask_of(order[::-1][:num_masked], shape))
    randoms = [run(mask) for mask in _random_masks(shape, num_masked, num_random, seed)]
    bpbs = np.array([r["bpb"] for r in randoms])
    random = {
        "loss": float(np.mean([r["loss"] for r in randoms])),
        "bpb": float(bpbs.mean()),
        "bpb_std": float(bpbs.std(ddof=1)) if len(bpbs) > 1 else 0.0,
        "bpb_min": float(bpbs.min()),
        "bpb_max": float(bpbs.max()),
        "num_seeds": num_random,
        "masks": [r["heads"] for r in randoms],
    }
    return {
        "num_masked": num_masked,
        "num_kv_heads_total": int(scores.size),
        "eval_bytes": base.num_bytes,
        "none": {"loss": base.loss, "bpb": base.bpb},
        "least": least,
        "random": random,
        "most": most,
        "delta_bpb": {
            k: v["bpb"] - base.bpb for k, v in (("least", least), ("random", random), ("most", most))
        },
        "least_below_random": least["bpb"] < random["bpb"],
        "least_below_all_random": least["bpb"] < random["bpb_min"],
        "random_below_most": random["bpb"] < most["bpb"],
    }


def _random_masks(shape: tuple[int, int], num_masked: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` distinct seeded masks of `num_masked` heads (fewer if fewer exist)."""
    rng = np.random.default_rng([seed, 2])
    total = math.comb(shape[0] * shape[1], num_masked)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < min(count, total):
        heads = tuple(sorted(int(i) for i in rng.permutation(shape[0] * shape[1])[:num_masked]))
        if heads not in chosen:
            chosen.append(heads)
    return [_mask_of(np.array(heads), shape) for heads in chosen]


def single_head_costs(model: TinyLM, windows: np.ndarray | torch.Tensor, batch_size: int = 32) -> np.ndarray:
    """(L, Hkv) held-out bits/byte added by masking each KV head alone: the ground truth
    the gradient scores approximate (they are a first-order estimate of it)."""
    cfg = model.cfg
    base = evaluate(model, windows, None, batch_size).bpb
    costs = np.zeros((cfg.num_layers, cfg.num_kv_heads))
    for layer in range(cfg.num_layers):
        for head in range(cfg.num_kv_heads):
            mask = np.zeros_like(costs, dtype=bool)
            mask[layer, head] = True
            gates = gates_for_dropped(mask, cfg.num_heads).to(model.dtype)
            costs[layer, head] = evaluate(model, windows, gates, batch_size).bpb - base
    return costs


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two equal-shape arrays (ranks by stable argsort; no tie averaging)."""
    ranks = [np.argsort(np.argsort(np.asarray(x, float).reshape(-1), kind="stable")) for x in (a, b)]
    return float(np.corrcoef(ranks[0], ranks[1])[0, 1])


def scores_path(plan_path: str | Path) -> Path:
    """Where the scores of a plan file go: `importance_plan.json` ->
    `importance_plan.scores.json`."""
    plan_path = Path(plan_path)
    return plan_path.with_name(plan_path.stem + ".scores.json")


def _corpus_for(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The training corpus of a checkpoint (its recorded CorpusConfig; the default when
    it records none) and whether this machine's copy matches the recorded fingerprint."""
    from preempt.lm.corpus import Corpus, CorpusConfig

    recorded = meta.get("train_config", {}).get("corpus")
    corpus = Corpus(CorpusConfig(**recorded) if isinstance(recorded, dict) else CorpusConfig())
    info = corpus.info()
    expected = meta.get("corpus", {}).get("sha256")
    return corpus, {**info, "matches_training": expected == info["sha256"] if expected else None}


def run_importance(
    model_path: str | Path, plan_out: str | Path, config: ImportanceConfig | None = None
) -> dict:
    """Score the heads of the checkpoint `model_path`, write the plan to `plan_out` and the
    scores next to it, run the masking comparison; return the report (also in the scores
    file)."""
    import time

    from preempt.lm.corpus import sample_windows, tile_windows
    from preempt.model.checkpoint import load_tiny_lm, read_tiny_lm

    config = config or ImportanceConfig()
    started = time.perf_counter()
    model_path, plan_out = Path(model_path), Path(plan_out)
    meta = read_tiny_lm(model_path)["meta"]
    model = load_tiny_lm(model_path, dtype=torch.float32)
    cfg = model.cfg
    seq_len = config.seq_len or int(meta.get("train_config", {}).get("seq_len", 256))
    corpus, corpus_info = _corpus_for(meta)

    num_calib = max(1, config.calib_bytes // (seq_len + 1))
    calib = sample_windows(corpus.stream("val"), num_calib, seq_len + 1, config.seed)
    raw = head_importance(model, calib, config.batch_size)  # (L, Hq)
    query_scores = normalise_per_layer(raw) if config.normalize == "layer" else raw
    kv_scores = kv_head_scores(query_scores, cfg.num_kv_heads)  # (L, Hkv)
    importance_s = time.perf_counter() - started

    source = (
        f"michel2019 |dL/dxi| on {model_path.name}: {num_calib} val windows of {seq_len + 1} bytes, "
        f"seed {config.seed}, normalize={config.normalize}, fp8_share={config.fp8_share} "
        f"drop_share={config.drop_share}"
    )
    plan = HeadPlan.from_importance(
        kv_scores.numpy(), fp8_share=config.fp8_share, drop_share=config.drop_share, source=source
    )
    plan_out.parent.mkdir(parents=True, exist_ok=True)
    plan.save(plan_out)

    held_out = tile_windows(corpus.stream("test"), seq_len + 1, config.eval_bytes)
    num_masked = max(1, plan.num_drop) if config.drop_share > 0 else max(1, round(0.1 * kv_scores.numel()))
    masking = masking_comparison(
        model, held_out, kv_scores, num_masked, num_random=config.num_random, seed=config.seed
    )
    single = None
    if config.single_head:
        costs = single_head_costs(model, held_out)
        single = {"delta_bpb": costs.tolist(), "rank_correlation": rank_correlation(kv_scores.numpy(), costs)}
    report = {
        "format": SCORES_FORMAT,
        "version": SCORES_VERSION,
        "model": str(model_path),
        "model_config": asdict(cfg),
        "plan": str(plan_out),
        "plan_layers": plan.to_dict()["layers"],
        "plan_counts": {"fp16": plan.num_fp16, "fp8": plan.num_fp8, "drop": plan.num_drop},
        "kv_head_scores": kv_scores.tolist(),
        "query_head_scores": query_scores.tolist(),
        "query_head_raw": raw.tolist(),
        "calibration": {
            "split": "val",
            "num_windows": num_calib,
            "window_bytes": seq_len + 1,
            "seed": config.seed,
        },
        "corpus": corpus_info,
        "config": asdict(config),
        "masking": masking,
        "single_head": single,
        "importance_wall_s": importance_s,
        "wall_s": time.perf_counter() - started,
    }
    scores_path(plan_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------- restored-prefix sensitivity
# What a lossy save actually costs is not whole-head removal (what the gates above rank)
# but the next tokens' distribution after the prefix comes back at a lower precision. So
# measure exactly that: per calibration window, the first `prefix_len` tokens' KV is saved
# and restored through the codec with one head at one class (every other head exact), the
# rest of the window is computed on top of it, and the score is the mean KL(p_exact ||
# p_restored) over the positions after the prefix (teacher-forced on the window's text).

SENSITIVITY_CLASSES = ("fp8", "fp8_token", "kivi4", "kivi2", "drop")


def clean_prefix_kv(model: TinyLM, windows: torch.Tensor) -> torch.Tensor:
    """(B, T) windows -> (B, L, 2, T, Hkv, D): the K/V a cache would hold (RoPE applied)."""
    out = []
    _forward_with_prefix(model, windows, None, capture=out)
    return torch.stack(out, dim=1)


def _forward_with_prefix(
    model: TinyLM,
    windows: torch.Tensor,  # (B, T) int64
    prefix_kv: torch.Tensor | None,  # (B, L, 2, P, Hkv, D): replaces K/V of positions < P
    masked_heads: np.ndarray | None = None,  # (L, Hkv) bool: heads whose prefix is hidden
    capture: list | None = None,
) -> torch.Tensor:
    """`forward_batch` with the first P positions' K/V replaced (a restored prefix) ->
    logits (B, T, V). Positions < P keep their replaced K/V whatever the layer below
    computed, as a restored cache does. Dropped heads' prefix is hidden from later
    positions, as attention masks it in the engine."""
    import torch.nn.functional as F

    from preempt.model.tiny import rope_cos_sin

    cfg = model.cfg
    batch, num_tokens = windows.shape
    group = cfg.num_heads // cfg.num_kv_heads
    positions = torch.arange(num_tokens)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, model.dtype, cfg.rope_scaling)
    prefix_len = 0 if prefix_kv is None else prefix_kv.shape[3]
    mask = None
    if masked_heads is not None and masked_heads.any():
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
        hide = (positions[None, :] < prefix_len) & (positions[:, None] >= prefix_len)  # (T, T)
        mask = causal & ~hide  # per query head below
    hidden = F.embedding(windows, model.embed_tokens)  # (B, T, hidden)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(hidden), cos, sin)  # (B, T, H, D)
        if capture is not None:
            capture.append(torch.stack([k, v], dim=1))  # (B, 2, T, Hkv, D)
        if prefix_len:
            k = torch.cat([prefix_kv[:, i, 0], k[:, prefix_len:]], dim=1)
            v = torch.cat([prefix_kv[:, i, 1], v[:, prefix_len:]], dim=1)
        q = q.transpose(1, 2)  # (B, Hq, T, D)
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        if mask is not None and masked_heads[i].any():
            hidden_heads = torch.as_tensor(masked_heads[i]).repeat_interleave(group)  # (Hq,)
            full = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
            layer_mask = torch.where(hidden_heads[:, None, None], mask[None], full[None])  # (Hq, T, T)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=layer_mask, scale=attn.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, num_tokens, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.logits(hidden)


def restore_through_codec(kv: torch.Tensor, plan: HeadPlan) -> torch.Tensor:
    """(L, 2, T, H, D) -> the same KV after a save and restore under `plan` (dropped heads
    zero): the codec's own quantize and dequantize, so the scores price the real format."""
    from preempt.kernels.quantize_heads import quantize_heads_ref
    from preempt.kernels.restore_blocks import dequantize_heads_ref

    return dequantize_heads_ref(quantize_heads_ref(kv.contiguous(), plan))


@torch.inference_mode()
def prefix_sensitivity(
    model: TinyLM,
    windows: np.ndarray | torch.Tensor,  # (B, T) token windows
    prefix_len: int,
    classes: tuple[str, ...] = SENSITIVITY_CLASSES,
    params: tuple[int, int, int] = (32, 4, 32),
    warmup_tokens: int = 2,
) -> dict[str, np.ndarray]:
    """class label -> (L, Hkv) mean KL (nats) of the next-token distributions after a
    restored prefix of `prefix_len` tokens with only that head at that class. The last
    `warmup_tokens` of the prefix are recomputed exactly, as the engine's restore does."""
    from preempt.kernels.plan import HeadClass

    cfg = model.cfg
    clean, kl = _restored_prefix_kl(model, windows, prefix_len, warmup_tokens)
    scores = {}
    shape = (cfg.num_layers, cfg.num_kv_heads)
    for label in classes:
        cls = HeadClass[label.upper()]
        uniform = HeadPlan.from_codes(np.full(shape, int(cls)), params=params)
        restored = torch.stack([restore_through_codec(kv, uniform) for kv in clean])  # (B, L, 2, P', H, D)
        table = np.zeros(shape)
        for layer in range(cfg.num_layers):
            for head in range(cfg.num_kv_heads):
                prefix = clean.clone()
                prefix[:, layer, :, :, head] = restored[:, layer, :, :, head]
                masked = None
                if cls == HeadClass.DROP:
                    masked = np.zeros(shape, dtype=bool)
                    masked[layer, head] = True
                table[layer, head] = kl(prefix, masked)
        scores[label] = table
    return scores


def _restored_prefix_kl(model: TinyLM, windows, prefix_len: int, warmup_tokens: int):
    """-> (the clean saved prefix KV (B, L, 2, P', H, D), kl(prefix, masked)): the mean
    KL(p_exact || p_restored) (nats) over the positions after the prefix when its first P'
    tokens' K/V are `prefix` and the last `warmup_tokens` are recomputed exactly."""
    windows = torch.as_tensor(np.asarray(windows), dtype=torch.int64)
    if not 0 < prefix_len < windows.shape[1]:
        raise ValueError(f"prefix_len must lie in (0, {windows.shape[1]}), got {prefix_len}")
    saved = prefix_len - min(warmup_tokens, prefix_len)
    clean = clean_prefix_kv(model, windows)[:, :, :, :saved]  # (B, L, 2, P', H, D)
    ref = torch.log_softmax(_forward_with_prefix(model, windows, None)[:, prefix_len:].double(), dim=-1)

    def kl(prefix: torch.Tensor, masked: np.ndarray | None = None) -> float:
        logits = _forward_with_prefix(model, windows, prefix, masked)[:, prefix_len:]
        out = torch.log_softmax(logits.double(), dim=-1)
        return float((ref.exp() * (ref - out)).sum(dim=-1).mean())

    return clean, kl


@torch.inference_mode()
def key_value_split(
    model: TinyLM,
    windows: np.ndarray | torch.Tensor,  # (B, T) token windows
    prefix_len: int,
    classes: tuple[str, ...] = ("fp8", "kivi4"),
    params: tuple[int, int, int] = (32, 4, 32),
    warmup_tokens: int = 2,
) -> dict[str, dict[str, float]]:
    """class label -> {"keys", "values", "both"}: the mean KL (nats) after a restored
    prefix with every head at that class, but only its keys (values exact), only its
    values, or both quantized. Says which half of the KV carries a class's loss (for KIVI:
    the per-channel keys, which enter a softmax; docs/codec.md)."""
    from preempt.kernels.plan import HeadClass

    cfg = model.cfg
    clean, kl = _restored_prefix_kl(model, windows, prefix_len, warmup_tokens)
    split = {}
    for label in classes:
        cls = HeadClass[label.upper()]
        if cls == HeadClass.DROP:
            raise ValueError("a dropped head has no keys or values to split: drop is not a class here")
        uniform = HeadPlan.from_codes(np.full((cfg.num_layers, cfg.num_kv_heads), int(cls)), params=params)
        restored = torch.stack([restore_through_codec(kv, uniform) for kv in clean])  # (B, L, 2, P', H, D)
        row = {}
        for part, index in (("keys", 0), ("values", 1)):
            prefix = clean.clone()
            prefix[:, :, index] = restored[:, :, index]
            row[part] = kl(prefix)
        row["both"] = kl(restored)
        split[label] = row
    return split


def class_sizes(classes: tuple[str, ...], prefix_len: int, head_dim: int, params) -> dict[str, float]:
    """class label -> one head's stored bytes over its 16-bit bytes for a `prefix_len` request."""
    from preempt.kernels.plan import HeadClass, head_bytes

    fp16 = 2 * prefix_len * head_dim * 2
    return {c: head_bytes(HeadClass[c.upper()], prefix_len, head_dim, 2, params) / fp16 for c in classes}


def plan_for_budget(
    scores: dict[str, np.ndarray],
    sizes: dict[str, float],
    budget: float,
    *,
    params: tuple[int, int, int],
    source: str = "",
    resolution: int = 1000,
) -> HeadPlan:
    """The plan minimising the summed per-head scores (each head one class of `scores`;
    FP16 costs 0) with mean size <= `budget` (x of FP16): a multiple-choice knapsack,
    solved exactly by dynamic programming over sizes rounded up to 1/`resolution` of a
    head. The scores are additive to first order (`preempt bench codec --model`: per-head
    FP8 KLs sum to 0.00203, all heads at FP8 at once give 0.00204; docs/codec.md)."""
    from preempt.kernels.plan import HeadClass

    labels = ["fp16", *scores]
    table = np.stack([np.zeros_like(next(iter(scores.values()))), *scores.values()])  # (C, L, H)
    num_classes, num_layers, num_heads = table.shape
    costs = np.array([math.ceil(sizes.get(c, 1.0) * resolution - 1e-9) for c in labels])
    capacity = int(math.floor(budget * num_layers * num_heads * resolution + 1e-9))
    if costs.min() * num_layers * num_heads > capacity:
        raise ValueError(
            f"no plan of these classes fits {budget}x of FP16 (the smallest is {costs.min() / resolution})"
        )
    flat = table.reshape(num_classes, -1)
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    choices = []
    for head in range(flat.shape[1]):
        options = np.full((num_classes, capacity + 1), np.inf)
        for c in range(num_classes):
            options[c, costs[c] :] = best[: capacity + 1 - costs[c]] + flat[c, head]
        choices.append(options.argmin(axis=0))
        best = options.min(axis=0)
    used = int(np.argmin(best))
    codes = np.zeros(flat.shape[1], dtype=np.int64)
    for head in reversed(range(flat.shape[1])):
        c = int(choices[head][used])
        codes[head] = int(HeadClass[labels[c].upper()])
        used -= costs[c]
    return HeadPlan.from_codes(codes.reshape(num_layers, num_heads), source, params=params)


def place_by_rank(plan: HeadPlan, importance: np.ndarray, sizes: dict[str, float], source: str) -> HeadPlan:
    """`plan`'s classes (the same multiset, so the same size) placed by `importance`:
    the most important head gets the largest class. The control that separates what a
    ranking buys from what the class mix buys."""
    labels = sorted((c.label for row in plan.classes for c in row), key=lambda c: sizes.get(c, 1.0))
    order = np.argsort(np.asarray(importance, float).reshape(-1), kind="stable")  # least first
    codes = np.zeros(len(labels), dtype=np.int64)
    from preempt.kernels.plan import HeadClass

    for rank, head in enumerate(order):
        codes[head] = int(HeadClass[labels[rank].upper()])
    return plan.with_classes(codes.reshape(plan.num_layers, plan.num_kv_heads), source)


def place_at_random(plan: HeadPlan, seed: int) -> HeadPlan:
    """`plan`'s classes shuffled over the heads by a seeded permutation."""
    codes = plan.codes().reshape(-1)
    shuffled = codes[np.random.default_rng([seed, 17]).permutation(codes.size)]
    return plan.with_classes(
        shuffled.reshape(plan.num_layers, plan.num_kv_heads), f"random placement seed={seed}"
    )
