"""The Triton kernels that quantize KIVI heads, and their wrapper `quantize_kivi`
(bit-exact against `quantize_kivi_ref`, tests/kernels/test_kivi.py).

Owns: `_kivi_keys_kernel` and `_kivi_values_kernel` (1, 2, 4 or 8 bits: whole codes per
byte, packed in the kernel), `_kivi_key_codes_kernel`, `_kivi_value_codes_kernel` and
`_kivi_pack_kernel` (any width: 3, 5, 6, 7 bits; one code per byte, then packed across
byte boundaries), the `@triton.jit` arithmetic they share (`_params16`, `_codes`), and
`quantize_kivi`, which runs them or the torch reference (preempt/kernels/dispatch.py). The format
and the reference are preempt/kernels/kivi_ref.py's. There is no dequantize kernel: a restore
decodes KIVI heads with the reference's torch ops, on any device (preempt/kernels/restore_blocks.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preempt.kernels import dispatch
from preempt.kernels.kivi_ref import Heads, _heads_info, layout_for, quantize_kivi_ref


@triton.jit
def _load_float32(ptrs, mask, SRC_KIND: tl.constexpr):
    """Cache elements (integer bits) as float32; bf16 by shifting its bits (the
    interpreter's bf16 conversion is wrong). Masked lanes read 0."""
    return dispatch.bits_to_float32(tl.load(ptrs, mask=mask, other=0), SRC_KIND)


@triton.jit
def _params16(low, high, levels):
    """A group's float16 (min, scale) from its float32 min and max, in float16's range
    (the smallest normal scale at least): `kivi_ref._params`' arithmetic."""
    scale = tl.math.div_rn(high - low, levels * 1.0)
    scale16 = tl.minimum(tl.maximum(scale, 0.00006103515625), 65504.0).to(tl.float16)
    low16 = tl.minimum(tl.maximum(low, -65504.0), 65504.0).to(tl.float16)
    return low16, scale16


@triton.jit
def _codes(x, low, scale, levels):
    """round((x - low) / scale) in [0, levels], half to even (adding 2^23, whose ulp is 1,
    rounds as the reference's torch.round does); `low`, `scale` float32, broadcast to x."""
    y = tl.math.div_rn(x - low, scale)
    y = tl.minimum(tl.maximum(y, 0.0), levels * 1.0)
    return ((y + 8388608.0) - 8388608.0).to(tl.int32)


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
        low16, scale16 = _params16(low, high, levels)
        par = params_ptr + head * (row_bytes // 2) + params_offset + group * 2 * head_dim
        tl.store(par + ch, low16.to(tl.int16, bitcast=True), mask=p_mask)
        tl.store(par + head_dim + ch, scale16.to(tl.int16, bitcast=True), mask=p_mask)
        q = _codes(x, low16.to(tl.float32)[None, :], scale16.to(tl.float32)[None, :], levels)
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
    low16, scale16 = _params16(low, high, levels)
    par = params_ptr + head * (row_bytes // 2) + params_offset + (t * num_groups + group) * 2
    tl.store(par, low16.to(tl.int16, bitcast=True), mask=t_mask)
    tl.store(par + 1, scale16.to(tl.int16, bitcast=True), mask=t_mask)
    packed = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.int32)
    for i in tl.static_range(PER_BYTE):
        x = _load_float32(src_rows + (p * PER_BYTE + i)[None, :], mask, SRC_KIND)
        q = _codes(x, low16.to(tl.float32)[:, None], scale16.to(tl.float32)[:, None], levels)
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


@triton.jit
def _kivi_key_codes_kernel(
    src_ptr,  # integer view of (n, 2, T, D), contiguous
    codes_ptr,  # uint8 (n, mid, D): one code per byte, packed by _kivi_pack_kernel
    params_ptr,  # int16 view of rows (float16 bits), (n, row_bytes / 2)
    num_tokens,
    head_dim,
    num_sink,
    num_mid,
    row_bytes,
    params_offset,  # int16 offset of the K params in a row
    group_size,
    SRC_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= group_size
    BLOCK_D: tl.constexpr,  # >= head_dim
):
    """Any key bits: one program per (head, key group), `_kivi_keys_kernel`'s arithmetic,
    the codes one per byte (a code of 3, 5 or 6 bits straddles bytes: the pack kernel
    assembles them)."""
    head = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    t = group * group_size + tl.arange(0, BLOCK_G)
    t_mask = (tl.arange(0, BLOCK_G) < group_size) & (t < num_mid)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    mask = t_mask[:, None] & d_mask[None, :]
    levels = (1 << BITS) - 1
    src = src_ptr + (head * 2 * num_tokens + num_sink + t[:, None]) * head_dim + d[None, :]
    x = _load_float32(src, mask, SRC_KIND)
    low = tl.min(tl.where(mask, x, float("inf")), axis=0)  # (BLOCK_D,)
    high = tl.max(tl.where(mask, x, float("-inf")), axis=0)
    low16, scale16 = _params16(low, high, levels)
    par = params_ptr + head * (row_bytes // 2) + params_offset + group * 2 * head_dim
    tl.store(par + d, low16.to(tl.int16, bitcast=True), mask=d_mask)
    tl.store(par + head_dim + d, scale16.to(tl.int16, bitcast=True), mask=d_mask)
    q = _codes(x, low16.to(tl.float32)[None, :], scale16.to(tl.float32)[None, :], levels)
    tl.store(codes_ptr + (head * num_mid + t[:, None]) * head_dim + d[None, :], q.to(tl.uint8), mask=mask)


@triton.jit
def _kivi_value_codes_kernel(
    src_ptr,  # integer view of (n, 2, T, D), contiguous
    codes_ptr,  # uint8 (n, mid, D)
    params_ptr,  # int16 view of rows (float16 bits)
    num_tokens,
    head_dim,
    num_sink,
    num_mid,
    row_bytes,
    params_offset,  # int16 offset of the V params in a row
    v_group,
    SRC_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,  # >= v_group
):
    """Any value bits: one program per (head, token tile, channel group),
    `_kivi_values_kernel`'s arithmetic, the codes one per byte."""
    head = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.program_id(2).to(tl.int64)
    num_groups = head_dim // v_group
    c = tl.arange(0, BLOCK_V)
    t_mask = t < num_mid
    mask = t_mask[:, None] & (c < v_group)[None, :]
    levels = (1 << BITS) - 1
    channel = group * v_group + c
    src = src_ptr + ((head * 2 + 1) * num_tokens + num_sink + t[:, None]) * head_dim + channel[None, :]
    x = _load_float32(src, mask, SRC_KIND)
    low = tl.min(tl.where(mask, x, float("inf")), axis=1)
    high = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    low16, scale16 = _params16(low, high, levels)
    par = params_ptr + head * (row_bytes // 2) + params_offset + (t * num_groups + group) * 2
    tl.store(par, low16.to(tl.int16, bitcast=True), mask=t_mask)
    tl.store(par + 1, scale16.to(tl.int16, bitcast=True), mask=t_mask)
    q = _codes(x, low16.to(tl.float32)[:, None], scale16.to(tl.float32)[:, None], levels)
    dst = codes_ptr + (head * num_mid + t[:, None]) * head_dim + channel[None, :]
    tl.store(dst, q.to(tl.uint8), mask=mask)


@triton.jit
def _kivi_pack_kernel(
    codes_ptr,  # uint8 (n, mid, D), codes < 2^BITS
    rows_ptr,  # uint8 (n, row_bytes)
    num_mid,
    head_dim,
    row_bytes,
    codes_offset,  # byte offset of this half's codes in a row
    BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= head_dim * BITS / 8
):
    """Codes -> the little-endian bit stream of `kivi_ref._pack_into`, any width: one
    program per (head, token tile); output byte p holds stream bits [8p, 8p + 8), from the
    codes of channels 8p // BITS .. (8p + 7) // BITS (at most 8 // BITS + 2 of them), each
    shifted into place."""
    SPAN: tl.constexpr = 8 // BITS + 2  # channels one byte can touch, at most (3 bits: 4)
    head = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.arange(0, BLOCK_P)
    num_packed = head_dim * BITS // 8
    mask = (t < num_mid)[:, None] & (p < num_packed)[None, :]
    byte = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.int32)
    for k in tl.static_range(SPAN):
        c = (8 * p) // BITS + k  # (BLOCK_P,) channel
        offset = c * BITS - 8 * p  # where code c starts relative to byte p's first bit
        touches = (c < head_dim) & (offset < 8)
        m = mask & touches[None, :]
        q = tl.load(codes_ptr + (head * num_mid + t[:, None]) * head_dim + c[None, :], mask=m, other=0)
        q = q.to(tl.int32)
        up = tl.maximum(offset, 0)[None, :]
        down = tl.maximum(-offset, 0)[None, :]
        byte = byte | (((q << up) >> down) & 0xFF)
    dst = rows_ptr + head * row_bytes + codes_offset + t[:, None] * num_packed + p[None, :]
    tl.store(dst, byte.to(tl.uint8), mask=mask)


def _quantize_kivi_any_bits(selected, rows, layout, bits, params, kind, src) -> None:
    """The key and value halves through the codes kernels and the pack kernel (any bits),
    into `rows` whose kept tokens are already written."""
    num_heads, _, num_tokens, head_dim = selected.shape
    sink, mid = layout.num_sink, layout.num_mid
    half = rows.view(torch.int16)
    k_codes = layout.full_bytes
    v_codes = k_codes + layout.k_code_bytes
    k_params = v_codes + layout.v_code_bytes
    v_params = k_params + layout.k_param_bytes
    codes = torch.empty(num_heads, mid, head_dim, dtype=torch.uint8, device=selected.device)
    group_size = params[0]
    device = selected.device
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(mid), 64))
    for offset, b, is_key in ((k_codes, bits[0], True), (v_codes, bits[1], False)):
        if is_key:
            dispatch.launchable(_kivi_key_codes_kernel, device)[(num_heads, layout.num_k_groups)](
                src, codes, half, num_tokens, head_dim, sink, mid, layout.nbytes, k_params // 2, group_size,
                SRC_KIND=kind, BITS=b, BLOCK_G=triton.next_power_of_2(group_size), BLOCK_D=block_d,
            )  # fmt: skip
        else:
            grid = (num_heads, triton.cdiv(mid, block_t), head_dim // layout.v_group)
            dispatch.launchable(_kivi_value_codes_kernel, device)[grid](
                src, codes, half, num_tokens, head_dim, sink, mid, layout.nbytes, v_params // 2,
                layout.v_group, SRC_KIND=kind, BITS=b, BLOCK_T=block_t,
                BLOCK_V=triton.next_power_of_2(layout.v_group),
            )  # fmt: skip
        dispatch.launchable(_kivi_pack_kernel, device)[(num_heads, triton.cdiv(mid, block_t))](
            codes, rows, mid, head_dim, layout.nbytes, offset,
            BITS=b, BLOCK_T=block_t, BLOCK_P=triton.next_power_of_2(head_dim * b // 8),
        )  # fmt: skip


def quantize_kivi(
    selected: Heads,
    bits: tuple[int, int],
    params: tuple[int, int, int],
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """selected (n, 2, T, D) (or n (2, T, D) views) -> (n, layout.nbytes) uint8 rows: the
    Triton kernels on CUDA (or under the interpreter when asked; the full-precision copy is
    a torch copy either way), the torch reference otherwise. Bits that divide 8 run the
    quantizing kernels, which pack whole codes per byte; 3, 5, 6 or 7 bits run the codes
    kernels and the pack kernel (`_quantize_kivi_any_bits`)."""
    _, _, _, _, device = _heads_info(selected)
    if any(b not in range(1, 9) for b in bits):
        raise ValueError(f"KIVI bits must lie in 1..8, got {bits}")
    if not dispatch.use_triton(device, use_triton):
        return quantize_kivi_ref(selected, bits, params)
    if not isinstance(selected, torch.Tensor):
        selected = torch.stack(list(selected))
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
    if any(8 % b for b in bits):
        _quantize_kivi_any_bits(selected, rows, layout, bits, params, kind, src)
        return rows
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
