"""FP8 E4M3 with one scale per token: the `FP8_TOKEN` head class (save and restore side).

Owns: the packed row of one FP8_TOKEN head, `quantize_fp8_token_ref` / `dequantize_fp8_token_ref`
(the torch references, and the CPU path), and the Triton kernel `_fp8_token_kernel` with
its wrapper `quantize_fp8_token` (bit-exact against the reference). It never decides the
plan (preempt/kernels/plan.py) and never writes the cache (preempt/kernels/restore_blocks.py).

Row layout of one head (uint8, `head_bytes(FP8_TOKEN, T, D, ...)` long):
    e4m3  (2, T, D)  K then V, value / scale rounded half-even, saturated to +-448
    scale (2, T)     float32 per (K or V, token): amax over the token's D channels / 448,
                     1.0 for an all-zero token
Dequantized value = float32(e4m3) * scale, rounded to the cache dtype.

Why: a per-head scale cannot follow tokens whose magnitude differs (attention-sink keys,
outlier tokens); a per-token scale puts each token's largest element on 448. It costs 4
bytes per (token, K or V) = 1 bit per element at D = 32 (0.56x of FP16 there, 0.52x at
D = 128), so it is an option for a head that FP8 per head serves badly, not a way under 0.5x.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from preempt.kernels import dispatch

_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code -> value


def row_bytes(num_tokens: int, head_dim: int) -> int:
    return 2 * num_tokens * (head_dim + 4)


def quantize_fp8_token_ref(selected: torch.Tensor) -> torch.Tensor:
    """selected (n, 2, T, D), any float dtype -> (n, row_bytes) uint8 rows (module doc)."""
    num_heads, _, num_tokens, head_dim = selected.shape
    out = torch.empty(num_heads, row_bytes(num_tokens, head_dim), dtype=torch.uint8, device=selected.device)
    if out.numel() == 0:
        return out
    # amax on the source dtype is exact (rounding to float32 is monotonic)
    amax = torch.maximum(selected.amax(dim=-1), -selected.amin(dim=-1)).float()  # (n, 2, T)
    scales = dispatch.fp8_scales(amax)
    values = (selected.float() / scales[..., None]).clamp_(-dispatch.FP8_MAX, dispatch.FP8_MAX)
    codes = out[:, : 2 * num_tokens * head_dim]
    codes.copy_(values.to(torch.float8_e4m3fn).view(torch.uint8).reshape(num_heads, -1))
    out[:, 2 * num_tokens * head_dim :].copy_(scales.reshape(num_heads, -1).view(torch.uint8))
    return out


def split_row(rows: torch.Tensor, num_tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, row_bytes) uint8 -> (codes (n, 2, T, D) uint8, scales (n, 2, T) float32), views
    when the scale section is 4-byte aligned, copies otherwise."""
    num_heads = rows.shape[0]
    split = 2 * num_tokens * head_dim
    if num_tokens == 0:
        return rows.new_empty(num_heads, 2, 0, head_dim), torch.empty(num_heads, 2, 0, device=rows.device)
    codes = rows[:, :split].reshape(num_heads, 2, num_tokens, head_dim)
    scales = rows[:, split:].contiguous().view(torch.float32).reshape(num_heads, 2, num_tokens)
    return codes, scales


def dequantize_fp8_token_ref(
    rows: torch.Tensor, num_tokens: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """(n, row_bytes) uint8 -> (n, 2, T, D) of `dtype`: float32(e4m3) * scale, rounded.
    Decodes through a 256-entry table (same bits as torch's upcast, which runs at only
    ~0.14 G elements/s on one CPU core)."""
    codes, scales = split_row(rows, num_tokens, head_dim)
    if codes.numel() == 0:
        return torch.empty(codes.shape, dtype=dtype, device=rows.device)
    values = _E4M3_VALUES.to(rows.device)[codes.to(torch.int64)]  # (n, 2, T, D) float32
    return (values * scales[..., None]).to(dtype)


@triton.jit
def _fp8_token_kernel(
    src_ptr,  # integer view of (n, 2, T, D) source heads, contiguous
    out_ptr,  # uint8 (n, row_bytes)
    scales_ptr,  # float32 view of the rows' scale sections: (n, 2, T) at stride row_bytes / 4
    num_tokens,
    head_dim,
    row_bytes,
    scale_row_stride,  # row_bytes // 4 (rows are 4-byte aligned: row_bytes = 2 T (D + 4))
    scale_offset,  # 2 T D / 4: where a row's scales start, in float32 elements
    SRC_KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (head, K or V, token tile): per token amax, scale, E4M3 bytes."""
    pid = tl.program_id(0).to(tl.int64)  # head * 2 + kv
    head = pid // 2
    kv = pid % 2
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t < num_tokens)[:, None] & (d < head_dim)[None, :]
    src = src_ptr + (pid * num_tokens + t[:, None]) * head_dim + d[None, :]
    bits = tl.load(src, mask=mask, other=0)
    x = dispatch.bits_to_float32(bits, SRC_KIND)
    amax = tl.max(tl.abs(x), axis=1)  # (BLOCK_T,)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    # E4M3 with round-half-even done in integers (as preempt/kernels/quantize_heads.py, same reasons)
    y_bits = y.to(tl.int32, bitcast=True)
    sign = (y_bits >> 24) & 0x80
    a_bits = y_bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    r = (a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) & 0x7FF00000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    byte = tl.where(a < 0.015625, sub, normal) | sign
    dst = out_ptr + head * row_bytes + (kv * num_tokens + t[:, None]) * head_dim + d[None, :]
    tl.store(dst, byte.to(tl.uint8), mask=mask)
    scale_dst = scales_ptr + head * scale_row_stride + scale_offset + kv * num_tokens + t
    tl.store(scale_dst, scale, mask=t < num_tokens)


def quantize_fp8_token(
    selected: torch.Tensor | Sequence[torch.Tensor], *, use_triton: bool | None = None
) -> torch.Tensor:
    """selected (n, 2, T, D) (or n (2, T, D) views) -> (n, row_bytes) uint8: the Triton
    kernel on CUDA (or under the interpreter when asked), the torch reference otherwise."""
    if not isinstance(selected, torch.Tensor):  # per-head views (preempt/kernels/kivi_ref.py's `Heads`)
        selected = torch.stack(list(selected))
    if selected.ndim != 4 or selected.shape[1] != 2:
        raise ValueError(f"selected heads must be (n, 2, T, D), got {tuple(selected.shape)}")
    if not dispatch.use_triton(selected.device, use_triton):
        return quantize_fp8_token_ref(selected)
    num_heads, _, num_tokens, head_dim = selected.shape
    size = row_bytes(num_tokens, head_dim)
    out = torch.empty(num_heads, size, dtype=torch.uint8, device=selected.device)
    if out.numel() == 0:
        return out
    src, kind = dispatch.storage_view(selected.contiguous())
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), 4096 // block_d))
    grid = (num_heads * 2, triton.cdiv(num_tokens, block_t))
    dispatch.launchable(_fp8_token_kernel, selected.device)[grid](
        src,
        out,
        out.view(torch.float32),
        num_tokens,
        head_dim,
        size,
        size // 4,
        num_tokens * head_dim // 2,
        SRC_KIND=kind,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    return out
