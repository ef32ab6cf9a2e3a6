"""The reference language model: a `TinyLM` trained on real text, so that quality
experiments (head importance, lossy KV saves) measure something a random model cannot.

This package owns the batched, cache-free forward used for training and evaluation
(`forward_batch`, with per-head gates) and held-out loss in bits per byte (`evaluate`).
`corpus` owns the training text (the running Python's standard-library sources, split by
file); `train` owns the run behind `preempt lm train` and its cached output (`lm.pt`,
written by `preempt.model.checkpoint`). Nothing here is imported by the engine, and
nothing here imports Lightning at module level.

`forward_batch` is `TinyLM.forward_naive` over a batch with SDPA instead of a hand-written
softmax: `forward_naive` stays the reference, and tests compare the two (logits and gate
gradients).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from preempt.model.tiny import TinyLM, rope_cos_sin


def forward_batch(
    model: TinyLM, input_ids: torch.Tensor, head_gates: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T) int64 sequences, each from position 0 -> logits (B, T, V).

    `head_gates`: (L, Hq) for the whole batch or (B, L, Hq) per sequence; multiplies each
    query head's attention output before o_proj, as in `forward_naive` (differentiable:
    per-sequence gates give per-sequence gradients in one backward pass)."""
    cfg = model.cfg
    batch, num_tokens = input_ids.shape
    if head_gates is not None and head_gates.shape[-2:] != (cfg.num_layers, cfg.num_heads):
        raise ValueError(
            f"head_gates must end in (num_layers, num_heads) = ({cfg.num_layers}, {cfg.num_heads}), "
            f"got {tuple(head_gates.shape)}"
        )
    group = cfg.num_heads // cfg.num_kv_heads
    positions = torch.arange(num_tokens, device=input_ids.device)
    cos, sin = rope_cos_sin(
        positions, cfg.head_dim, cfg.rope_theta, model.dtype, cfg.rope_scaling
    )  # (T, 1, D)
    hidden = F.embedding(input_ids, model.embed_tokens)  # (B, T, hidden)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(hidden), cos, sin)  # (B, T, H, D)
        q = q.transpose(1, 2)  # (B, Hq, T, D)
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, T, D)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)  # (B, Hq, T, D)
        if head_gates is not None:
            gates = head_gates[..., i, :].to(out.dtype)  # (Hq,) or (B, Hq)
            out = out * gates.reshape(-1 if gates.dim() == 2 else 1, cfg.num_heads, 1, 1)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, num_tokens, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.logits(hidden)  # (B, T, V)


def next_byte_loss(
    model: TinyLM, windows: torch.Tensor, head_gates: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T+1) windows -> (B,) mean next-byte cross-entropy (nats) of each window."""
    logits = forward_batch(model, windows[:, :-1], head_gates)  # (B, T, V)
    targets = windows[:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none")  # (B, T)
    return losses.mean(dim=1)


class HeldOut(NamedTuple):
    loss: float  # mean next-byte cross-entropy, nats
    bpb: float  # bits per byte (= per token: the vocabulary is bytes)
    num_bytes: int  # bytes predicted


@torch.inference_mode()
def evaluate(
    model: TinyLM,
    windows: np.ndarray | torch.Tensor,
    head_gates: torch.Tensor | None = None,
    batch_size: int = 32,
) -> HeldOut:
    """Mean next-byte loss over (N, T+1) windows (each predicts its last T bytes), with
    optional (L, Hq) head gates, e.g. heads masked as a lossy save would."""
    windows = torch.as_tensor(windows, dtype=torch.int64)
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        total += float(next_byte_loss(model, windows[start : start + batch_size], head_gates).double().sum())
    loss = total / windows.shape[0]  # every window predicts the same number of bytes
    return HeldOut(loss, loss / math.log(2), windows.shape[0] * (windows.shape[1] - 1))
