"""KIVI-style 4-bit and 2-bit KV heads (Liu et al. 2024, arXiv 2402.02750): the `KIVI4` and
`KIVI2` head classes.

Owns: the packed row of one KIVI head, `quantize_kivi_ref` / `dequantize_kivi_ref` (torch
references and the CPU path), and the Triton kernels `_kivi_keys_kernel`,
`_kivi_values_kernel` with their wrapper `quantize_kivi` (bit-exact against the
reference). It never decides the plan (kernels/plan.py) and never writes the cache.

Format (per head; `kernels.plan.kivi_layout` gives the byte counts):
- the first `num_sink` tokens (attention sink) and the last `num_recent` tokens: bit-exact
  copies at the cache dtype. The sink soaks up attention mass in every head and the
  recent tokens carry most of a next token's attention: both cost little and pay most.
- keys of the tokens between: per channel, over groups of `group_size` tokens (KIVI's
  finding: key outliers live in fixed channels, so one (min, scale) per channel fits);
- values of the tokens between: per token, over groups of `group_size` channels (values
  have no channel outliers; the attention output mixes them per token).
- per group: min and scale = (max - min) / (2^bits - 1) as float16 (scale floored at 2^-14
  and both clamped to +-65504, so float16 never overflows); code q = round-half-even of
  (float32(x) - min) / scale, clamped to [0, 2^bits - 1]; value = q * scale + min in float32,
  rounded to the cache dtype. q * scale is exact in float32 (at most 4 + 11 significant
  bits), so a fused multiply-add gives the same bits as a multiply then an add.
- codes packed little-end first along the channel: 4-bit two per byte, 2-bit four.

Row layout (uint8): full (2, sink + recent, D) cache dtype | K codes (mid, D*b/8) |
V codes (mid, D*b/8) | K params (groups, 2, D) float16 (min row, scale row) |
V params (mid, D / v_group, 2) float16 (min, scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dispatch
from kernels.plan import KiviLayout, kivi_layout

HALF_MAX = 65504.0
MIN_SCALE = 2.0**-14  # the smallest normal float16: a flat group still divides safely


def layout_for(
    bits: tuple[int, int], selected_shape: tuple[int, ...], dtype: torch.dtype, params
) -> KiviLayout:
    _, _, num_tokens, head_dim = selected_shape
    return kivi_layout(bits, num_tokens, head_dim, torch.empty((), dtype=dtype).element_size(), params)


def _params(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 group min and max -> (min, scale) as float16 (module doc)."""
    scale = ((high - low) / (2**bits - 1)).clamp_(MIN_SCALE, HALF_MAX).to(torch.float16)
    return low.clamp(-HALF_MAX, HALF_MAX).to(torch.float16), scale


def _codes(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values and broadcastable float16 (min, scale) -> uint8 codes. Clamping
    before rounding equals clamping after: the bounds are integers."""
    y = ((x - low.float()) / scale.float()).clamp_(0, 2**bits - 1)
    return torch.round(y).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) uint8 codes < 2^bits -> (..., D * bits / 8): a little-endian bit stream,
    channel c in bits [c * bits, (c + 1) * bits) (for 2/4/8 bits: whole codes per byte,
    the lowest channel in the low bits)."""
    if 8 % bits == 0:
        per_byte = 8 // bits
        grouped = codes.reshape(*codes.shape[:-1], -1, per_byte)
        out = grouped[..., 0].clone()
        for j in range(1, per_byte):
            out |= grouped[..., j] << (bits * j)
        return out
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes[..., None] >> shifts) & 1).reshape(*codes.shape[:-1], -1, 8)  # (..., bytes, 8)
    weights = (2 ** torch.arange(8, device=codes.device)).to(torch.uint8)
    return (stream * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[..., None] >> shifts) & (2**bits - 1)  # (..., D * bits / 8, per_byte)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    stream = (packed[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    stream = stream.reshape(*packed.shape[:-1], -1, bits)  # (..., D, bits)
    weights = (2 ** torch.arange(bits, device=packed.device)).to(torch.uint8)
    return (stream * weights).sum(dim=-1, dtype=torch.uint8)


def _sections(rows: torch.Tensor, layout: KiviLayout) -> list[torch.Tensor]:
    """Split (n, nbytes) rows into their five sections (views)."""
    sizes = [
        layout.full_bytes,
        layout.k_code_bytes,
        layout.v_code_bytes,
        layout.k_param_bytes,
        layout.v_param_bytes,
    ]
    return list(torch.split(rows, sizes, dim=1))


def quantize_kivi_ref(
    selected: torch.Tensor, bits: tuple[int, int], params: tuple[int, int, int]
) -> torch.Tensor:
    """selected (n, 2, T, D), any float dtype -> (n, layout.nbytes) uint8 rows (module doc);
    `bits` = (key bits, value bits)."""
    group_size = params[0]
    k_bits, v_bits = bits
    layout = layout_for(bits, tuple(selected.shape), selected.dtype, params)
    num_heads, _, num_tokens, head_dim = selected.shape
    sink, mid = layout.num_sink, layout.num_mid
    rows = torch.empty(num_heads, layout.nbytes, dtype=torch.uint8, device=selected.device)
    if rows.numel() == 0:
        return rows
    full, k_codes, v_codes, k_params, v_params = _sections(rows, layout)
    kept = torch.cat([selected[:, :, :sink], selected[:, :, sink + mid :]], dim=2)  # (n, 2, s + r, D)
    full.copy_(kept.contiguous().view(torch.uint8).reshape(num_heads, -1))
    if mid == 0:
        return rows
    keys = selected[:, 0, sink : sink + mid].float()  # (n, mid, D)
    values = selected[:, 1, sink : sink + mid].float()
    # keys: per channel over groups of group_size tokens; a short last group repeats its
    # last token, which moves neither its min nor its max
    padded = torch.clamp(torch.arange(layout.num_k_groups * group_size, device=keys.device), max=mid - 1)
    grouped = keys[:, padded].reshape(num_heads, layout.num_k_groups, group_size, head_dim)
    k_low, k_scale = _params(grouped.amin(dim=2), grouped.amax(dim=2), k_bits)  # (n, groups, D)
    group_of = torch.arange(mid, device=keys.device) // group_size
    k_q = _codes(keys, k_low[:, group_of], k_scale[:, group_of], k_bits)
    k_codes.copy_(_pack(k_q, k_bits).reshape(num_heads, -1))
    k_params.copy_(torch.stack([k_low, k_scale], dim=2).view(torch.uint8).reshape(num_heads, -1))
    # values: per token over groups of v_group channels
    grouped = values.reshape(num_heads, mid, head_dim // layout.v_group, layout.v_group)
    v_low, v_scale = _params(grouped.amin(dim=3), grouped.amax(dim=3), v_bits)  # (n, mid, G)
    v_q = _codes(grouped, v_low[..., None], v_scale[..., None], v_bits).reshape(num_heads, mid, head_dim)
    v_codes.copy_(_pack(v_q, v_bits).reshape(num_heads, -1))
    v_params.copy_(torch.stack([v_low, v_scale], dim=3).view(torch.uint8).reshape(num_heads, -1))
    return rows


def dequantize_kivi_ref(
    rows: torch.Tensor, bits: tuple[int, int], num_tokens: int, head_dim: int, dtype: torch.dtype, params
) -> torch.Tensor:
    """(n, layout.nbytes) uint8 rows -> (n, 2, T, D) of `dtype`."""
    group_size = params[0]
    k_bits, v_bits = bits
    layout = kivi_layout(bits, num_tokens, head_dim, torch.empty((), dtype=dtype).element_size(), params)
    num_heads = rows.shape[0]
    sink, mid, recent = layout.num_sink, layout.num_mid, layout.num_recent
    out = torch.empty(num_heads, 2, num_tokens, head_dim, dtype=dtype, device=rows.device)
    if out.numel() == 0:
        return out
    full, k_codes, v_codes, k_params, v_params = (s.contiguous() for s in _sections(rows, layout))
    kept = full.view(dtype).reshape(num_heads, 2, sink + recent, head_dim)
    out[:, :, :sink] = kept[:, :, :sink]
    out[:, :, sink + mid :] = kept[:, :, sink:]
    if mid == 0:
        return out
    k_q = _unpack(k_codes.reshape(num_heads, mid, -1), k_bits).float()  # (n, mid, D)
    k_par = k_params.view(torch.float16).reshape(num_heads, layout.num_k_groups, 2, head_dim).float()
    group_of = torch.arange(mid, device=rows.device) // group_size
    out[:, 0, sink : sink + mid] = (k_q * k_par[:, group_of, 1] + k_par[:, group_of, 0]).to(dtype)
    num_groups = head_dim // layout.v_group
    v_q = _unpack(v_codes.reshape(num_heads, mid, -1), v_bits).float()
    v_q = v_q.reshape(num_heads, mid, num_groups, layout.v_group)
    v_par = v_params.view(torch.float16).reshape(num_heads, mid, num_groups, 2).float()
    v_hat = v_q * v_par[..., 1:2] + v_par[..., 0:1]
    out[:, 1, sink : sink + mid] = v_hat.reshape(num_heads, mid, head_dim).to(dtype)
    return out


@triton.jit
def _load_float32(ptrs, mask, SRC_KIND: tl.constexpr):
    """Cache elements (integer bits) as float32; bf16 by shifting its bits (the
    interpreter's bf16 conversion is wrong). Masked lanes read 0."""
    bits = tl.load(ptrs, mask=mask, other=0)
    if SRC_KIND == 0:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    elif SRC_KIND == 1:
        x = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif SRC_KIND == 2:
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.float64, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _kivi_keys_kernel(
    src_ptr,  # integer view of (n, 2, T, D), contiguous
    rows_ptr,  # uint8 (n, row_bytes)
    params_ptr,  # int16 view of rows (float16 bits), (n, row_bytes / 2)
    num_tokens,
    head_dim,
    num_sink,
    num_mid,
    row_bytes,
    codes_offset,  # byte offset of the K codes in a row
    params_offset,  # int16 offset of the K params in a row
    group_size,
    SRC_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= group_size
    BLOCK_P: tl.constexpr,  # >= head_dim * BITS / 8 (packed columns)
):
    """One program per (head, key group): per channel min/max over the group's tokens,
    float16 params, codes packed 8 / BITS channels per byte."""
    PER_BYTE: tl.constexpr = 8 // BITS
    head = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    t = group * group_size + tl.arange(0, BLOCK_G)  # within the quantized span
    t_mask = (tl.arange(0, BLOCK_G) < group_size) & (t < num_mid)
    p = tl.arange(0, BLOCK_P)
    num_packed = head_dim * BITS // 8
    p_mask = p < num_packed
    mask = t_mask[:, None] & p_mask[None, :]
    levels = (1 << BITS) - 1
    packed = tl.zeros([BLOCK_G, BLOCK_P], dtype=tl.int32)
    src_rows = src_ptr + (head * 2 * num_tokens + num_sink + t[:, None]) * head_dim
    for i in tl.static_range(PER_BYTE):
        ch = p * PER_BYTE + i
        x = _load_float32(src_rows + ch[None, :], mask, SRC_KIND)
        low = tl.min(tl.where(mask, x, float("inf")), axis=0)  # (BLOCK_P,)
        high = tl.max(tl.where(mask, x, float("-inf")), axis=0)
        scale = tl.math.div_rn(high - low, levels * 1.0)
        scale16 = tl.minimum(tl.maximum(scale, 0.00006103515625), 65504.0).to(tl.float16)
        low16 = tl.minimum(tl.maximum(low, -65504.0), 65504.0).to(tl.float16)
        par = params_ptr + head * (row_bytes // 2) + params_offset + group * 2 * head_dim
        tl.store(par + ch, low16.to(tl.int16, bitcast=True), mask=p_mask)
        tl.store(par + head_dim + ch, scale16.to(tl.int16, bitcast=True), mask=p_mask)
        y = tl.math.div_rn(x - low16.to(tl.float32)[None, :], scale16.to(tl.float32)[None, :])
        y = tl.minimum(tl.maximum(y, 0.0), levels * 1.0)
        q = ((y + 8388608.0) - 8388608.0).to(tl.int32)  # round half to even: ulp is 1 at 2^23
        packed = packed | (q << (BITS * i))
    dst = rows_ptr + head * row_bytes + codes_offset + t[:, None] * num_packed + p[None, :]
    tl.store(dst, packed.to(tl.uint8), mask=mask)


@triton.jit
def _kivi_values_kernel(
    src_ptr,  # integer view of (n, 2, T, D), contiguous
    rows_ptr,  # uint8 (n, row_bytes)
    params_ptr,  # int16 view of rows (float16 bits)
    num_tokens,
    head_dim,
    num_sink,
    num_mid,
    row_bytes,
    codes_offset,  # byte offset of the V codes in a row
    params_offset,  # int16 offset of the V params in a row
    v_group,
    SRC_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= v_group * BITS / 8
):
    """One program per (head, token tile, channel group): per token min/max over the
    group's channels, float16 params, packed codes."""
    PER_BYTE: tl.constexpr = 8 // BITS
    head = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.program_id(2).to(tl.int64)
    num_groups = head_dim // v_group
    p = tl.arange(0, BLOCK_P)
    group_packed = v_group * BITS // 8
    t_mask = t < num_mid
    mask = t_mask[:, None] & (p < group_packed)[None, :]
    levels = (1 << BITS) - 1
    src_rows = src_ptr + ((head * 2 + 1) * num_tokens + num_sink + t[:, None]) * head_dim + group * v_group
    low = tl.full([BLOCK_T], float("inf"), tl.float32)
    high = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for i in tl.static_range(PER_BYTE):
        x = _load_float32(src_rows + (p * PER_BYTE + i)[None, :], mask, SRC_KIND)
        low = tl.minimum(low, tl.min(tl.where(mask, x, float("inf")), axis=1))
        high = tl.maximum(high, tl.max(tl.where(mask, x, float("-inf")), axis=1))
    scale = tl.math.div_rn(high - low, levels * 1.0)
    scale16 = tl.minimum(tl.maximum(scale, 0.00006103515625), 65504.0).to(tl.float16)
    low16 = tl.minimum(tl.maximum(low, -65504.0), 65504.0).to(tl.float16)
    par = params_ptr + head * (row_bytes // 2) + params_offset + (t * num_groups + group) * 2
    tl.store(par, low16.to(tl.int16, bitcast=True), mask=t_mask)
    tl.store(par + 1, scale16.to(tl.int16, bitcast=True), mask=t_mask)
    packed = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.int32)
    for i in tl.static_range(PER_BYTE):
        x = _load_float32(src_rows + (p * PER_BYTE + i)[None, :], mask, SRC_KIND)
        y = tl.math.div_rn(x - low16.to(tl.float32)[:, None], scale16.to(tl.float32)[:, None])
        y = tl.minimum(tl.maximum(y, 0.0), levels * 1.0)
        q = ((y + 8388608.0) - 8388608.0).to(tl.int32)
        packed = packed | (q << (BITS * i))
    num_packed = head_dim * BITS // 8
    dst = (
        rows_ptr
        + head * row_bytes
        + codes_offset
        + t[:, None] * num_packed
        + group * group_packed
        + p[None, :]
    )
    tl.store(dst, packed.to(tl.uint8), mask=mask)


def quantize_kivi(
    selected: torch.Tensor,
    bits: tuple[int, int],
    params: tuple[int, int, int],
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """selected (n, 2, T, D) -> (n, layout.nbytes) uint8 rows: the Triton kernels on CUDA
    (or under the interpreter when asked; the full-precision copy is a torch copy either
    way), the torch reference otherwise. The kernels pack whole codes per byte, so key
    or value bits of 3, 5 or 6 run the torch reference on every device (torch ops, on the
    GPU too)."""
    if selected.ndim != 4 or selected.shape[1] != 2:
        raise ValueError(f"selected heads must be (n, 2, T, D), got {tuple(selected.shape)}")
    if any(b not in range(1, 9) for b in bits):
        raise ValueError(f"KIVI bits must lie in 1..8, got {bits}")
    if any(8 % b for b in bits) or not dispatch.use_triton(selected.device, use_triton):
        return quantize_kivi_ref(selected, bits, params)
    layout = layout_for(bits, tuple(selected.shape), selected.dtype, params)
    num_heads, _, num_tokens, head_dim = selected.shape
    sink, mid = layout.num_sink, layout.num_mid
    rows = torch.empty(num_heads, layout.nbytes, dtype=torch.uint8, device=selected.device)
    if rows.numel() == 0:
        return rows
    selected = selected.contiguous()
    full = rows[:, : layout.full_bytes]
    kept = torch.cat([selected[:, :, :sink], selected[:, :, sink + mid :]], dim=2)
    full.copy_(kept.contiguous().view(torch.uint8).reshape(num_heads, -1))
    if mid == 0:
        return rows
    if (
        layout.full_bytes + layout.k_code_bytes + layout.v_code_bytes
    ) % 2:  # float16 params must sit at even offsets
        raise ValueError(f"KIVI row of {layout.nbytes} bytes does not align its float16 params")
    src, kind = dispatch.storage_view(selected)
    half = rows.view(torch.int16)
    k_codes = layout.full_bytes
    v_codes = k_codes + layout.k_code_bytes
    k_params = v_codes + layout.v_code_bytes
    v_params = k_params + layout.k_param_bytes
    group_size = params[0]
    k_bits, v_bits = bits
    block_p = triton.next_power_of_2(head_dim * k_bits // 8)
    dispatch.launchable(_kivi_keys_kernel, selected.device)[(num_heads, layout.num_k_groups)](
        src, rows, half, num_tokens, head_dim, sink, mid, layout.nbytes, k_codes, k_params // 2,
        group_size, SRC_KIND=kind, BITS=k_bits, BLOCK_G=triton.next_power_of_2(group_size), BLOCK_P=block_p,
    )  # fmt: skip
    block_t = max(1, min(triton.next_power_of_2(mid), 64))
    num_groups = head_dim // layout.v_group
    grid = (num_heads, triton.cdiv(mid, block_t), num_groups)
    dispatch.launchable(_kivi_values_kernel, selected.device)[grid](
        src, rows, half, num_tokens, head_dim, sink, mid, layout.nbytes, v_codes, v_params // 2,
        layout.v_group, SRC_KIND=kind, BITS=v_bits, BLOCK_T=block_t,
        BLOCK_P=triton.next_power_of_2(layout.v_group * v_bits // 8),
    )  # fmt: skip
    return rows
