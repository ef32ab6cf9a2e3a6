"""KIVI-style KV heads (Liu et al. 2024, arXiv 2402.02750): the `KIVI4`, `KIVI2` and
`KIVI_K<k>V<v>` head classes.

Owns: the packed row of one KIVI head, `quantize_kivi_ref` / `dequantize_kivi_ref` (the
torch references), `quantize_kivi_kv` (the CPU path: every KIVI head of a request at once,
the same bytes), and the Triton kernels `_kivi_keys_kernel`, `_kivi_values_kernel` (1, 2,
4, 8 bits) and `_kivi_key_codes_kernel`, `_kivi_value_codes_kernel`, `_kivi_pack_kernel`
(any width: 3, 5, 6, 7 bits) with their wrapper `quantize_kivi` (bit-exact against the
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

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import dispatch
from kernels.plan import KiviLayout, kivi_layout

HALF_MAX = 65504.0
MIN_SCALE = 2.0**-14  # the smallest normal float16: a flat group still divides safely
ROUNDER = 2.0**23  # float32 x + 2^23 rounds x in [0, 2^23) half to even, to an integer
_CHUNK_ELEMS = 1 << 17  # elements per CPU chunk: its 512 KB float32 buffer stays in L2


def layout_for(
    bits: tuple[int, int], selected_shape: tuple[int, ...], dtype: torch.dtype, params
) -> KiviLayout:
    _, _, num_tokens, head_dim = selected_shape
    return kivi_layout(bits, num_tokens, head_dim, torch.empty((), dtype=dtype).element_size(), params)


def _params(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 group min and max -> (min, scale) as float16 (module doc)."""
    scale = ((high - low) / (2**bits - 1)).clamp_(MIN_SCALE, HALF_MAX).to(torch.float16)
    return low.clamp(-HALF_MAX, HALF_MAX).to(torch.float16), scale


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte run of `bits`-bit codes: 8 / gcd(bits, 8)
    codes fill bits / gcd(bits, 8) bytes (3-bit: 8 codes in 3 bytes, 6-bit: 4 in 3)."""
    codes = 8 // math.gcd(bits, 8)
    return codes, codes * bits // 8


def _pack_into(q: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Codes -> the little-endian bit stream `out` (..., D * bits / 8) uint8: channel c in
    bits [c * bits, (c + 1) * bits) (for 2/4/8 bits whole codes per byte, the lowest
    channel in the low bits). `q` (..., D) int32 holds each code in its low byte; its
    upper 8 bits may be anything (the quantizer leaves float32 bits of 2^23 + code there)
    and the two bytes in between must be zero. The codes of one whole-byte run are OR-ed into
    one int32 whose low bytes are the run's bytes (5 bits: two 20-bit halves; 7 bits: int64),
    so packing is a few shifts per run instead of a loop over bits."""
    if bits == 8:
        out.copy_(q.view(torch.uint8)[..., ::4])
        return
    per_unit, unit_bytes = _unit(bits)
    runs = q.unflatten(-1, (-1, per_unit))  # (..., D / per_unit, per_unit)
    out = out.unflatten(-1, (-1, unit_bytes))
    if per_unit * bits <= 24:
        _copy_low_bytes(_or_shifted(runs, bits), out)
        return
    half = per_unit // 2
    low_bits = half * bits
    whole, rest = divmod(low_bits, 8)
    if low_bits + rest <= 24:  # 5 bits: two 20-bit halves, each in int32
        low = _or_shifted(runs[..., :half], bits)  # stream bits [0, 20)
        high = _or_shifted(runs[..., half:], bits)  # stream bits [20, 40)
        _copy_low_bytes(low, out[..., :whole])
        tail = torch.bitwise_right_shift(low, 8 * whole).bitwise_and_(2**rest - 1)
        _copy_low_bytes(tail.bitwise_or_(high.bitwise_left_shift_(rest)), out[..., whole:])
        return
    # 7 bits: the upper byte of a code would reach the stream: widen the codes alone
    _copy_low_bytes(_or_shifted(runs.view(torch.uint8)[..., ::4].to(torch.int64), bits), out)


def _or_shifted(runs: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., m) codes -> (...,) the OR of code j shifted left by j * bits."""
    per_unit = runs.shape[-1]
    acc = torch.bitwise_left_shift(runs[..., per_unit - 1], bits * (per_unit - 1))
    shifted = torch.empty_like(acc)
    for j in range(per_unit - 2, 0, -1):
        acc.bitwise_or_(torch.bitwise_left_shift(runs[..., j], bits * j, out=shifted))
    return acc.bitwise_or_(runs[..., 0])


def _copy_low_bytes(acc: torch.Tensor, out: torch.Tensor) -> None:
    """out (..., k) uint8 <- the k low bytes of each integer of acc (...,) (little-endian)."""
    out.copy_(acc.view(torch.uint8).unflatten(-1, (-1, acc.element_size()))[..., : out.shape[-1]])


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) uint8 codes < 2^bits -> (..., D * bits / 8) packed (`_pack_into`)."""
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] * bits // 8, dtype=torch.uint8, device=codes.device)
    _pack_into(codes.to(torch.int32), bits, out)
    return out


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """(..., D * bits / 8) uint8 -> codes into `out` (..., D), int32 or float32: each run's
    bytes assembled into one integer (`_pack_into`), then one shift and mask per code."""
    if bits == 8:
        out.copy_(packed)
        return
    per_unit, unit_bytes = _unit(bits)
    runs = packed.unflatten(-1, (-1, unit_bytes))  # (..., D / per_unit, unit_bytes)
    acc = runs[..., unit_bytes - 1].to(torch.int64 if unit_bytes > 3 else torch.int32)
    for k in range(unit_bytes - 2, -1, -1):
        acc.bitwise_left_shift_(8).bitwise_or_(runs[..., k])
    codes = out.unflatten(-1, (-1, per_unit))
    shifted = torch.empty_like(acc)
    for j in range(per_unit):
        torch.bitwise_right_shift(acc, bits * j, out=shifted)
        codes[..., j] = shifted.bitwise_and_(2**bits - 1)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D * bits / 8) packed -> (..., D) uint8 codes."""
    shape = (*packed.shape[:-1], packed.shape[-1] * 8 // bits)
    out = torch.empty(shape, dtype=torch.int32, device=packed.device)
    _unpack_into(packed, bits, out)
    return out.to(torch.uint8)


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


Heads = torch.Tensor | Sequence[torch.Tensor]  # (n, 2, T, D), or n views of (2, T, D)


def _heads_info(selected: Heads) -> tuple[int, int, int, torch.dtype, torch.device]:
    """(n, T, D, dtype, device) of a tensor of heads or a list of per-head views."""
    if isinstance(selected, torch.Tensor):
        if selected.ndim != 4 or selected.shape[1] != 2:
            raise ValueError(f"selected heads must be (n, 2, T, D), got {tuple(selected.shape)}")
        num_heads, _, num_tokens, head_dim = selected.shape
        return num_heads, num_tokens, head_dim, selected.dtype, selected.device
    if not selected:
        raise ValueError("a list of heads needs at least one (2, T, D) view (pass a tensor for none)")
    shapes = {tuple(h.shape) for h in selected}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[0] != 2:
        raise ValueError(f"per-head views must all be (2, T, D), got {sorted(shapes)}")
    _, num_tokens, head_dim = selected[0].shape
    return len(selected), num_tokens, head_dim, selected[0].dtype, selected[0].device


def _span(selected: Heads, kv: int, start: int, stop: int, buffer: torch.Tensor) -> torch.Tensor:
    """Tokens [start, stop) of K (kv=0) or V of every head, (n, stop - start, D): a view of
    a tensor, or the per-head views stacked into `buffer` (a chunk, so it stays in cache)."""
    if isinstance(selected, torch.Tensor):
        return selected[:, kv, start:stop]
    shape = (len(selected), stop - start, selected[0].shape[-1])
    out = buffer[: math.prod(shape)].view(shape)
    return torch.stack([h[kv, start:stop] for h in selected], out=out)


def quantize_kivi_ref(selected: Heads, bits: tuple[int, int], params: tuple[int, int, int]) -> torch.Tensor:
    """selected (n, 2, T, D) (or n (2, T, D) views, e.g. heads of a (L, 2, T, H, D) cache,
    read without a gathered copy), any float dtype -> (n, layout.nbytes) uint8 rows (module
    doc); `bits` = (key bits, value bits).

    CPU speed: the quantized span goes through in chunks of whole key groups of about
    `_CHUNK_ELEMS` elements, each pass of a chunk on one reused float32 buffer (a fresh
    whole-request temporary per step would pay its page faults and miss the cache every
    pass). Round half to even and the uint8 conversion are one add of 2^23 (the float32
    ulp there is 1), whose low byte is the code (`_pack_into`)."""
    group_size = params[0]
    k_bits, v_bits = bits
    num_heads, num_tokens, head_dim, dtype, device = _heads_info(selected)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = kivi_layout(bits, num_tokens, head_dim, itemsize, params)
    sink, mid, recent = layout.num_sink, layout.num_mid, layout.num_recent
    rows = torch.empty(num_heads, layout.nbytes, dtype=torch.uint8, device=device)
    if rows.numel() == 0:
        return rows
    full, k_codes, v_codes, k_params, v_params = _sections(rows, layout)
    full = full.view(num_heads, 2, sink + recent, head_dim * itemsize)  # the kept tokens' bytes
    heads = [selected] if isinstance(selected, torch.Tensor) else [h[None] for h in selected]
    for i, head in enumerate(heads):  # one step for a tensor, one per view for a list
        source = head.view(torch.uint8)  # (h, 2, T, D * itemsize)
        full[i : i + len(head), :, :sink] = source[:, :, :sink]
        full[i : i + len(head), :, sink:] = source[:, :, sink + mid :]
    if mid == 0:
        return rows
    k_codes = k_codes.view(num_heads, mid, -1)
    v_codes = v_codes.view(num_heads, mid, -1)
    k_params = k_params.view(num_heads, layout.num_k_groups, 2, 2 * head_dim)  # float16 bytes
    v_groups = head_dim // layout.v_group
    v_params = v_params.view(num_heads, mid, v_groups, 2, 2)
    step = max(1, _CHUNK_ELEMS // (num_heads * head_dim * group_size)) * group_size
    chunk = min(step, mid) * num_heads * head_dim
    stacked = torch.empty(chunk, dtype=dtype, device=device)
    work = torch.empty(chunk, dtype=torch.float32, device=device)
    for start in range(0, mid, step):
        stop = min(mid, start + step)
        keys = _span(selected, 0, sink + start, sink + stop, stacked)  # (n, t, D)
        whole = (stop - start) // group_size * group_size
        for lo, hi in ((0, whole), (whole, stop - start)):  # whole groups, then a short last one
            if hi > lo:
                groups = keys[:, lo:hi].unflatten(1, (-1, min(group_size, hi - lo)))  # (n, g, G, D)
                first = (start + lo) // group_size
                low, scale = _quantize_groups(groups, 2, k_bits, work, k_codes[:, start + lo : start + hi])
                k_params[:, first : first + groups.shape[1], 0] = low.view(torch.uint8)
                k_params[:, first : first + groups.shape[1], 1] = scale.view(torch.uint8)
        values = _span(selected, 1, sink + start, sink + stop, stacked)
        groups = values.unflatten(2, (v_groups, layout.v_group))  # (n, t, G, v_group)
        low, scale = _quantize_groups(groups, 3, v_bits, work, v_codes[:, start:stop])
        v_params[:, start:stop, :, 0] = low.view(torch.uint8).unflatten(-1, (v_groups, 2))
        v_params[:, start:stop, :, 1] = scale.view(torch.uint8).unflatten(-1, (v_groups, 2))
    return rows


def _quantize_groups(
    groups: torch.Tensor, dim: int, bits: int, work: torch.Tensor, codes_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: `groups` (n, a, b, c) reduced over `dim` (2: keys' tokens, 3: values'
    channels) -> float16 (min, scale) of each group, and the packed codes written to
    `codes_out` (n, t, D * bits / 8)."""
    # min/max on the source dtype are exact (rounding to float32 is monotonic); amin and
    # amax apart, as torch.aminmax runs ~8x slower on these shapes here
    low, high = groups.amin(dim=dim), groups.amax(dim=dim)
    low, scale = _params(low.float(), high.float(), bits)
    y = work[: groups.numel()].view(groups.shape)
    if groups.dtype == torch.float32:
        torch.sub(groups, low.float().unsqueeze(dim), out=y)
    else:  # float32 first, as the kernel loads it (a float64 difference would round differently)
        y.copy_(groups).sub_(low.float().unsqueeze(dim))
    y.div_(scale.float().unsqueeze(dim)).clamp_(0, 2**bits - 1).add_(ROUNDER)
    _pack_into(y.view(torch.int32).flatten(dim - 1, dim), bits, codes_out)  # (n, t, D)
    return low, scale


def dequantize_kivi_ref(
    rows: torch.Tensor, bits: tuple[int, int], num_tokens: int, head_dim: int, dtype: torch.dtype, params
) -> torch.Tensor:
    """(n, layout.nbytes) uint8 rows -> (n, 2, T, D) of `dtype`: value = code * scale + min
    in float32 (one fused multiply-add: the product is exact, module doc), rounded to
    `dtype`; in chunks of about `_CHUNK_ELEMS` elements, as `quantize_kivi_ref`."""
    group_size = params[0]
    k_bits, v_bits = bits
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = kivi_layout(bits, num_tokens, head_dim, itemsize, params)
    num_heads = rows.shape[0]
    sink, mid, recent = layout.num_sink, layout.num_mid, layout.num_recent
    out = torch.empty(num_heads, 2, num_tokens, head_dim, dtype=dtype, device=rows.device)
    if out.numel() == 0:
        return out
    full, k_codes, v_codes, k_params, v_params = _sections(rows, layout)
    kept = full.view(num_heads, 2, sink + recent, head_dim * itemsize)
    out_bytes = out.view(torch.uint8)
    out_bytes[:, :, :sink] = kept[:, :, :sink]
    out_bytes[:, :, sink + mid :] = kept[:, :, sink:]
    if mid == 0:
        return out
    k_codes = k_codes.view(num_heads, mid, -1)
    v_codes = v_codes.view(num_heads, mid, -1)
    # float16 params as float32 (small: one (min, scale) per group)
    k_par = _aligned(k_params).view(torch.float16).view(num_heads, -1, 2, head_dim).float()
    v_groups = head_dim // layout.v_group
    v_par = _aligned(v_params).view(torch.float16).view(num_heads, mid, v_groups, 2).float()
    step = max(1, _CHUNK_ELEMS // (num_heads * head_dim * group_size)) * group_size
    work = torch.empty(min(step, mid) * num_heads * head_dim, dtype=torch.float32, device=rows.device)
    result = work if dtype != torch.float32 else None
    for start in range(0, mid, step):
        stop = min(mid, start + step)
        span = (num_heads, stop - start, head_dim)
        target = out[:, 0, sink + start : sink + stop]
        q = work[: math.prod(span)].view(span)
        _unpack_into(k_codes[:, start:stop], k_bits, q)
        group_of = torch.arange(start, stop, device=rows.device) // group_size
        low, scale = k_par[:, group_of, 0], k_par[:, group_of, 1]  # (n, t, D)
        _fma_into(q, scale, low, target, result)
        target = out[:, 1, sink + start : sink + stop]
        _unpack_into(v_codes[:, start:stop], v_bits, q)
        q = q.unflatten(2, (v_groups, layout.v_group))
        low, scale = v_par[:, start:stop, :, 0:1], v_par[:, start:stop, :, 1:2]
        _fma_into(q, scale, low, target.unflatten(2, (v_groups, layout.v_group)), result)
    return out


def _aligned(section: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a rows' byte section, or the section itself when it already is
    contiguous at an even offset (viewing bytes as float16 needs both; one row at an odd
    offset is contiguous but not aligned)."""
    if section.is_contiguous() and section.storage_offset() % 2 == 0:
        return section
    return section.clone(memory_format=torch.contiguous_format)


def _fma_into(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, target: torch.Tensor, work) -> None:
    """target = q * scale + low (float32), rounded to target's dtype. `work` None: target is
    float32 and takes the result directly; else the result goes through `q` (in place)."""
    if work is None:
        torch.addcmul(low, q, scale, out=target)
    else:
        target.copy_(q.mul_(scale).add_(low))


@triton.jit
def _load_float32(ptrs, mask, SRC_KIND: tl.constexpr):
    """Cache elements (integer bits) as float32; bf16 by shifting its bits (the
    interpreter's bf16 conversion is wrong). Masked lanes read 0."""
    return dispatch.bits_to_float32(tl.load(ptrs, mask=mask, other=0), SRC_KIND)


@triton.jit
def _params16(low, high, levels):
    """A group's float16 (min, scale) from its float32 min and max, in float16's range
    (the smallest normal scale at least): `_params`' arithmetic."""
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
    """Codes -> the little-endian bit stream of `_pack_into`, any width: one program per
    (head, token tile); output byte p holds stream bits [8p, 8p + 8), from the codes of
    channels 8p // BITS .. (8p + 7) // BITS (at most 8 // BITS + 2 of them), each shifted
    into place."""
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
    a torch copy either way), the torch reference otherwise. The kernels pack whole codes
    per byte, so key or value bits of 3, 5 or 6 run the torch reference on every device
    (torch ops, on the GPU too)."""
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


# ---- the batched CPU path: every KIVI head of a request at once ---------------------------

_BATCH_ELEMS = 1 << 18  # float32 elements per batched chunk (all heads): 1 MB, half of L2
_SCRATCH_MAX_BYTES = 1 << 22  # temporaries up to 4 MB are kept per thread between calls
_SCRATCH = threading.local()


def _scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a temporary, its memory kept for this thread's next call.
    Why: a fresh megabyte-sized CPU temporary pays a page fault per 4 kB on every call (a
    2048-token request's temporaries all did); a buffer used again does not. Larger ones
    (long requests, big models) are allocated each time, so a thread holds at most its
    ten slots of up to `_SCRATCH_MAX_BYTES` each."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or nbytes > _SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    pool = _SCRATCH.__dict__.setdefault("pool", {})
    buffer = pool.get(slot)
    if buffer is None or buffer.numel() < nbytes:
        buffer = pool[slot] = torch.empty(nbytes, dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(shape)


class KiviClass(NamedTuple):
    """One KIVI class of a plan: its heads (slot order) and (key bits, value bits)."""

    layers: np.ndarray  # (n,) layer of each head
    heads: np.ndarray  # (n,) KV head of each head
    bits: tuple[int, int]


def quantize_kivi_kv(
    kv: torch.Tensor, classes: Sequence[KiviClass], params: tuple[int, int, int]
) -> list[torch.Tensor]:
    """kv (L, 2, T, H, D) with contiguous (H, D) rows -> per class its (n, layout.nbytes)
    rows, the same bytes as `quantize_kivi_ref` of that class's heads (tested), computed
    for every head of the request at once: the float passes (min, max, subtract, divide,
    clamp, round) run on (l, t, H, D) chunks of all heads whatever their class, and codes
    are packed once per bit width and layer block (`l` layers: the whole request for the
    tiny LM, one or two layers for a served model's 2048-token request), so a 2048-token
    request of the tiny LM is about a hundred torch calls instead of a few dozen per head
    and class.

    What differs per head is only the number of levels. The group scales divide by a
    per-head levels tensor (true division either way: same bits as the scalar), and codes
    are clamped to [0, 255] in float and to the head's levels on the uint8 codes (equal:
    rounding is monotonic and the bounds are integers). Worth it when most heads are KIVI
    heads (`quantize_heads_ref` decides); the float work on other heads is discarded."""
    num_layers, _, num_tokens, num_heads, head_dim = kv.shape
    itemsize, device = kv.element_size(), kv.device
    group_size = params[0]
    layouts = [kivi_layout(c.bits, num_tokens, head_dim, itemsize, params) for c in classes]
    rows = [
        torch.empty(len(c.layers), lay.nbytes, dtype=torch.uint8, device=device)
        for c, lay in zip(classes, layouts, strict=True)
    ]
    if not classes or num_tokens == 0:
        return rows
    first = layouts[0]  # the token split and the groups do not depend on the bits
    sink, mid, recent, v_group = first.num_sink, first.num_mid, first.num_recent, first.v_group
    sections = [_sections(r, lay) for r, lay in zip(rows, layouts, strict=True)]
    source = kv.view(torch.uint8)  # (L, 2, T, H, D * itemsize)
    for c, (full, *_) in zip(classes, sections, strict=True):
        full = full.view(len(c.layers), 2, sink + recent, head_dim * itemsize)
        full[:, :, :sink] = source[c.layers, :, :sink, c.heads]
        full[:, :, sink:] = source[c.layers, :, sink + mid :, c.heads]
    if mid == 0:
        return rows
    levels = np.ones((2, num_layers, 1, num_heads, 1), dtype=np.float32)
    for c in classes:
        levels[:, c.layers, 0, c.heads, 0] = np.array([[2**b - 1] for b in c.bits])
    k_levels, v_levels = torch.from_numpy(levels).to(device)
    v_groups = head_dim // v_group
    # Blocks of layers x tokens: as many layers at once as keep a block's codes (one byte per
    # element of K or V) within a scratch buffer and a key-group chunk within _BATCH_ELEMS,
    # and, when one layer's codes alone would not fit (a served model's 8192-token request:
    # 8.4 MB a layer), a span of whole key groups of it. Then a block's codes are packed
    # while they are still in cache: a 2048-token request has 67 MB of key codes, and
    # whole-request (or whole-layer) code tensors went through memory, on fresh pages, at
    # every packing step (an 8192-token encode ran ~20% slower per byte for it).
    per_token = num_heads * head_dim
    span = (
        mid
        if per_token * mid <= _SCRATCH_MAX_BYTES
        else max(1, _SCRATCH_MAX_BYTES // (per_token * group_size)) * group_size
    )
    lstep = min(
        num_layers,
        max(1, _SCRATCH_MAX_BYTES // (per_token * span)),
        max(1, _BATCH_ELEMS // (per_token * group_size)),
    )
    step = max(1, _BATCH_ELEMS // (lstep * per_token * group_size)) * group_size
    work = _scratch("work", (lstep * min(step, mid) * per_token,), torch.float32, device)
    for l0 in range(0, num_layers, lstep):
        l1 = min(num_layers, l0 + lstep)
        nl = l1 - l0
        kl, vl = k_levels[l0:l1], v_levels[l0:l1]
        for t0 in range(0, mid, span):  # spans start on key-group boundaries
            t1 = min(mid, t0 + span)
            # the block's results, head-major (l * H, ...) so that a class's heads are whole
            # rows, the params already as a row holds them: K (groups, min / scale, D), V
            # (tokens, G, min / scale)
            kc = _scratch("k_codes", (nl, num_heads, t1 - t0, head_dim), torch.uint8, device)
            vc = _scratch("v_codes", (nl, num_heads, t1 - t0, head_dim), torch.uint8, device)
            kp = _scratch(
                "k_par", (nl, num_heads, -(-(t1 - t0) // group_size), 2, head_dim), torch.float16, device
            )
            vp = _scratch("v_par", (nl, num_heads, t1 - t0, v_groups, 2), torch.float16, device)
            for start in range(0, t1 - t0, step):  # relative to t0
                stop = min(t1 - t0, start + step)
                keys = kv[l0:l1, 0, sink + t0 + start : sink + t0 + stop]  # (l, t, H, D)
                whole = (stop - start) // group_size * group_size
                for lo, hi in ((0, whole), (whole, stop - start)):  # whole groups, then a short last one
                    if hi > lo:
                        groups = keys[:, lo:hi].unflatten(
                            1, (-1, min(group_size, hi - lo))
                        )  # (l, g, G, H, D)
                        g0 = (start + lo) // group_size
                        low, scale = _quantize_batch(groups, 2, kl, work, kc[:, :, start + lo : start + hi])
                        kp[:, :, g0 : g0 + groups.shape[1], 0] = low.transpose(1, 2)
                        kp[:, :, g0 : g0 + groups.shape[1], 1] = scale.transpose(1, 2)
                values = kv[l0:l1, 1, sink + t0 + start : sink + t0 + stop].unflatten(-1, (v_groups, v_group))
                low, scale = _quantize_batch(values, 4, vl, work, vc[:, :, start:stop])  # (l, t, H, G, g) in
                vp[:, :, start:stop, :, 0] = low.transpose(1, 2)
                vp[:, :, start:stop, :, 1] = scale.transpose(1, 2)
            _emit_block(classes, sections, l0, l1, num_heads, kc, vc, kp, vp, t0, t0 // group_size)
    return rows


def _emit_block(
    classes, sections, l0: int, l1: int, num_heads: int, kc, vc, kp, vp, t0: int, g0: int
) -> None:
    """Layers [l0, l1) of every class into its rows: codes clamped to the class's levels and
    packed once per bit width (the block's heads of every class with those bits together),
    params copied. `kc`, `vc` (l, H, t, D) uint8 codes of the t tokens from `t0` (key group
    `g0`) of the middle section; every section is token- (or group-) major, so the span is
    one byte range of each row. `kp`, `vp` the span's params."""
    flat = (l1 - l0) * num_heads
    device = kc.device
    num_tokens, head_dim = kc.shape[2], kc.shape[3]
    # per class: its rows in this block (slot order need not be layer-major) and their heads
    # in the block's head-major order
    which = [np.flatnonzero((c.layers >= l0) & (c.layers < l1)) for c in classes]
    local = [
        torch.as_tensor((c.layers[r] - l0) * num_heads + c.heads[r], dtype=torch.int64, device=device)
        for c, r in zip(classes, which, strict=True)
    ]
    for kv_index, codes in enumerate((kc.view(flat, -1), vc.view(flat, -1))):
        for bits, members in _by_bits(classes, kv_index).items():
            members = [i for i in members if len(which[i])]
            if not members:
                continue
            heads = torch.cat([local[i] for i in members])
            if len(heads) == flat and bool((heads == torch.arange(flat, device=device)).all()):
                picked = codes  # every head, in order (a uniform plan): no other group reads them
            else:
                picked = _scratch("picked", (len(heads), codes.shape[1]), torch.uint8, device)
                torch.index_select(codes, 0, heads, out=picked)
            if bits < 8:
                picked.clamp_(max=2**bits - 1)
            row_bytes = head_dim * bits // 8  # one token's codes
            packed = _scratch("packed", (len(heads), num_tokens, row_bytes), torch.uint8, device)
            _pack_codes(picked.view(len(heads), num_tokens, head_dim), bits, packed)
            offset = 0
            for i in members:
                n = len(which[i])
                section = sections[i][1 + kv_index][:, t0 * row_bytes : (t0 + num_tokens) * row_bytes]
                _put_rows(section, which[i], packed[offset : offset + n].view(n, -1))
                offset += n
    kp, vp = kp.reshape(flat, -1).view(torch.uint8), vp.reshape(flat, -1).view(torch.uint8)
    for i, (_, _, _, kp_out, vp_out) in enumerate(sections):
        if len(which[i]):
            k_at = g0 * 4 * head_dim  # a key group's params: (min, scale) x D float16
            _put_rows(kp_out[:, k_at : k_at + kp.shape[1]], which[i], kp.index_select(0, local[i]))
            v_at = t0 * (vp.shape[1] // num_tokens)  # a token's: G x (min, scale) float16
            _put_rows(vp_out[:, v_at : v_at + vp.shape[1]], which[i], vp.index_select(0, local[i]))


def _put_rows(section: torch.Tensor, rows: np.ndarray, values: torch.Tensor) -> None:
    """section[rows] = values: a slice copy when the rows are consecutive (slot order is
    layer-major in every plan), an indexed one otherwise."""
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == len(rows):
        section[first : last + 1].copy_(values)
    else:
        section[torch.as_tensor(rows, device=section.device)] = values


def _by_bits(classes: Sequence[KiviClass], kv_index: int) -> dict[int, list[int]]:
    """Key (kv_index 0) or value bits -> the classes (their indices) that use them."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(classes):
        groups.setdefault(c.bits[kv_index], []).append(i)
    return groups


def _quantize_batch(
    groups: torch.Tensor, dim: int, levels: torch.Tensor, work: torch.Tensor, codes_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of every head: `groups` (L, a, b, H, c) keys (dim 2: tokens) or
    (L, t, H, G, g) values (dim 4: channels) -> float16 (min, scale) of each group
    (the reduced shape), codes clamped to [0, 255] written to `codes_out` (L, H, t, D) uint8.
    `levels` broadcasts against the reduced shape (per head: 2^bits - 1)."""
    y = work[: groups.numel()].view(groups.shape)
    # min and max of float32 values (exact either way: rounding to float32 is monotonic): of
    # the source for a float32 cache, else of its float32 copy, which the subtraction needs
    # anyway (float32 first, as quantize_kivi_ref) and which reduces ~2.5x faster than bfloat16
    source = groups if groups.dtype == torch.float32 else y.copy_(groups)
    low, high = source.amin(dim=dim).float(), source.amax(dim=dim).float()
    scale = ((high - low) / levels).clamp_(MIN_SCALE, HALF_MAX).to(torch.float16)
    low = low.clamp_(-HALF_MAX, HALF_MAX).to(torch.float16)
    if source is groups:
        torch.sub(groups, low.float().unsqueeze(dim), out=y)
    else:  # in place (torch.sub promoting a 16-bit source runs 2x slower than a copy and a sub)
        y.sub_(low.float().unsqueeze(dim))
    if dim == groups.ndim - 1:  # values: addcdiv broadcasting over the last dim runs ~5x slower
        y.div_(scale.float().unsqueeze(dim)).clamp_(0, 255).add_(ROUNDER)
    else:
        # 2^23 + y / scale in one pass (the division and the addition each rounded, as div_
        # then add_), then the clamp on the sum: [2^23, 2^23 + 255] after the add is [0, 255]
        # before it for every y (y < 0 lands at or below 2^23, y > 255 at or above 2^23 + 255,
        # and in between the add rounds as it would after the clamp)
        torch.addcdiv(_rounder(y), y, scale.float().unsqueeze(dim), out=y).clamp_(ROUNDER, ROUNDER + 255)
    num_layers, num_tokens = codes_out.shape[0], codes_out.shape[2]
    bits = y.view(torch.int32).view(num_layers, num_tokens, -1, codes_out.shape[-1])  # (L, t, H, D)
    codes_out.transpose(1, 2).copy_(bits)  # int32 -> uint8 keeps the low byte: the code
    return low, scale


def _rounder(like: torch.Tensor) -> torch.Tensor:
    """2^23 as a 0-d float32 tensor on `like`'s device (addcdiv's input), built once."""
    pool = _SCRATCH.__dict__.setdefault("rounder", {})
    if like.device not in pool:
        pool[like.device] = torch.tensor(ROUNDER, dtype=torch.float32, device=like.device)
    return pool[like.device]


def _pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """(..., D) uint8 codes < 2^bits, contiguous -> the bit stream `out` (..., D * bits / 8),
    contiguous, of `_pack_into` (same bytes), by halving steps inside machine words instead
    of a shift per code: the codes of one whole-byte run (`_unit`: 2, 4 or 8 codes) are one
    little-endian int16/32/64 word, and each step merges neighbouring lanes, (even lane) |
    (odd lane) >> (8 - bits) * width, width 1, 2, then 4 bytes; after log2(codes per run)
    steps the word's low bytes are the run's stream. 1, 2 and 4 bits (one byte per run)
    keep it by a narrowing integer conversion, which keeps the low byte; 3, 5, 6 and 7 bits
    by a byte copy. Every step is a contiguous elementwise op on whole words."""
    if bits == 8:
        out.copy_(codes)
        return
    per_unit, unit_bytes = _unit(bits)
    words = codes.view(_WORD[per_unit])  # (..., D / per_unit): one run per word
    merged = _scratch("merged", tuple(words.shape), words.dtype, words.device)
    spare = _scratch("spare", tuple(words.shape), words.dtype, words.device)
    width, source = 1, words  # lane width in bytes
    while width < per_unit:
        low, high = _lane_masks(per_unit, width)
        shift = (8 - bits) * width
        torch.bitwise_right_shift(source, shift, out=spare).bitwise_and_(high >> shift)
        torch.bitwise_and(source, low, out=merged).bitwise_or_(spare)
        width, source = 2 * width, merged
    if unit_bytes == 1:
        out.copy_(merged)  # int -> uint8 keeps the low byte
    else:
        _copy_low_bytes(merged, out.unflatten(-1, (-1, unit_bytes)))


_WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes -> the integer of one run


def _lane_masks(word_bytes: int, width: int) -> tuple[int, int]:
    """(even lanes, odd lanes) masks of `width`-byte lanes in a `word_bytes` word, as the
    word's signed integer values (the odd-lanes mask is only used shifted right, positive)."""
    lane = (1 << (8 * width)) - 1
    low = sum(lane << (16 * width * i) for i in range(word_bytes // (2 * width)))
    high = low << (8 * width)
    return low, high


def dequantize_kivi_kv(
    rows: Sequence[torch.Tensor],
    classes: Sequence[KiviClass],
    params: tuple[int, int, int],
    out: torch.Tensor,
) -> None:
    """The inverse of `quantize_kivi_kv`: each class's (n, layout.nbytes) rows -> its heads
    written into `out` (L, 2, T, H, D) of the cache dtype, the same values as
    `dequantize_kivi_ref` (tested). The float pass (code * scale + min, rounded to the
    dtype) runs on (L, t, H, D) chunks of every head and writes `out` in place, so the
    caller writes the other classes' heads (and zeros for dropped ones) afterwards."""
    num_layers, _, num_tokens, num_heads, head_dim = out.shape
    itemsize, device = out.element_size(), out.device
    group_size = params[0]
    layouts = [kivi_layout(c.bits, num_tokens, head_dim, itemsize, params) for c in classes]
    if not classes or num_tokens == 0:
        return
    first = layouts[0]
    sink, mid, recent, v_group = first.num_sink, first.num_mid, first.num_recent, first.v_group
    sections = [_sections(r, lay) for r, lay in zip(rows, layouts, strict=True)]
    target = out.view(torch.uint8)  # (L, 2, T, H, D * itemsize)
    for c, (full, *_) in zip(classes, sections, strict=True):
        full = full.view(len(c.layers), 2, sink + recent, head_dim * itemsize)
        target[c.layers, :, :sink, c.heads] = full[:, :, :sink]
        target[c.layers, :, sink + mid :, c.heads] = full[:, :, sink:]
    if mid == 0:
        return
    flat = num_layers * num_heads
    num_groups, v_groups = first.num_k_groups, head_dim // v_group
    index = [
        torch.as_tensor(c.layers * num_heads + c.heads, dtype=torch.int64, device=device) for c in classes
    ]
    k_codes = _scratch("k_codes", (flat, mid, head_dim), torch.uint8, device)
    v_codes = _scratch("v_codes", (flat, mid, head_dim), torch.uint8, device)
    k_par = _scratch("k_par", (flat, num_groups * 2 * head_dim * 2), torch.uint8, device)
    v_par = _scratch("v_par", (flat, mid * v_groups * 2 * 2), torch.uint8, device)
    for i, (_, k_in, v_in, kp_in, vp_in) in enumerate(sections):
        n = len(index[i])
        for codes, bits, packed in ((k_codes, classes[i].bits[0], k_in), (v_codes, classes[i].bits[1], v_in)):
            unpacked = _scratch("unpacked", (n, mid, head_dim), torch.uint8, device)
            _unpack_codes(packed.view(n, mid, -1), bits, unpacked)
            codes.index_copy_(0, index[i], unpacked)
        k_par.index_copy_(0, index[i], kp_in)  # bytes: any alignment of the rows' sections
        v_par.index_copy_(0, index[i], vp_in)
    # head-major views: K (L, H, groups, min / scale, D), V (L, H, mid, G, min / scale)
    k_par = k_par.view(torch.float16).view(num_layers, num_heads, num_groups, 2, head_dim)
    v_par = v_par.view(torch.float16).view(num_layers, num_heads, mid, v_groups, 2)
    k_codes = k_codes.view(num_layers, num_heads, mid, head_dim)
    v_codes = v_codes.view(num_layers, num_heads, mid, head_dim)
    step = max(1, _BATCH_ELEMS // (num_layers * num_heads * head_dim * group_size)) * group_size
    work = _scratch("work", (num_layers * min(step, mid) * num_heads * head_dim,), torch.float32, device)
    for start in range(0, mid, step):
        stop = min(mid, start + step)
        whole = (stop - start) // group_size * group_size
        for lo, hi in ((0, whole), (whole, stop - start)):  # whole groups, then a short last one
            if hi > lo:
                size = min(group_size, hi - lo)
                g0 = (start + lo) // group_size
                g1 = g0 + (hi - lo) // size
                par = k_par[:, :, g0:g1].float().permute(0, 2, 1, 3, 4).unsqueeze(2)  # (L, g, 1, H, 2, D)
                dst = out[:, 0, sink + start + lo : sink + start + hi].unflatten(1, (-1, size))
                codes = k_codes[:, :, start + lo : start + hi].transpose(1, 2)  # (L, t, H, D)
                _dequantize_batch(codes, par[..., 0, :], par[..., 1, :], work, dst)
        par = v_par[:, :, start:stop].float().transpose(1, 2)  # (L, t, H, G, 2)
        dst = out[:, 1, sink + start : sink + stop].unflatten(-1, (v_groups, v_group))
        codes = v_codes[:, :, start:stop].transpose(1, 2)
        _dequantize_batch(codes, par[..., 0:1], par[..., 1:2], work, dst)


def _dequantize_batch(
    codes: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, work: torch.Tensor, dst: torch.Tensor
) -> None:
    """dst (any view of the cache dtype) = codes * scale + low in float32, rounded: codes
    (L, t, H, D) uint8 as float32 into `work`, viewed like `dst`; low and scale broadcast."""
    q = work[: codes.numel()].view(codes.shape)
    q.copy_(codes)
    q = q.view(dst.shape)
    if dst.dtype == torch.float32:
        torch.addcmul(low, q, scale, out=dst)
    else:
        dst.copy_(q.mul_(scale).add_(low))


def _unpack_codes(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """(n, ..., D * bits / 8) bit stream (`_pack_into`), rows contiguous -> the codes into
    `out` (n, ..., D) uint8, contiguous: `_pack_codes` backwards. Each run's bytes go into
    the low bytes of one word (a widening conversion for one-byte runs, a byte copy for the
    others), then halving steps in reverse split each lane into two, the odd half moved up
    by (8 - bits) * width bits, width 4, 2, then 1 byte."""
    if bits == 8:
        out.copy_(packed)
        return
    per_unit, unit_bytes = _unit(bits)
    word = _WORD[per_unit]
    merged = _scratch("merged", (*out.shape[:-1], out.shape[-1] // per_unit), word, out.device)
    if unit_bytes == 1:
        merged.copy_(packed)  # uint8 -> a wider integer: zero-extended
    else:
        merged.zero_()
        merged.view(torch.uint8).unflatten(-1, (-1, per_unit))[..., :unit_bytes].copy_(
            packed.unflatten(-1, (-1, unit_bytes))
        )
    spare = _scratch("spare", tuple(merged.shape), word, out.device)
    width = per_unit // 2
    while width >= 1:
        low, high = _lane_masks(per_unit, width)
        keep = _lane_bits(per_unit, width, bits * width)  # each 2w lane's low b * w bits
        shift = (8 - bits) * width
        moved = _signed(high & (keep << 8 * width), word)  # where the odd half lands
        torch.bitwise_left_shift(merged, shift, out=spare).bitwise_and_(moved)
        merged.bitwise_and_(keep).bitwise_or_(spare)
        width //= 2
    out.view(word).view(merged.shape).copy_(merged)


def _lane_bits(word_bytes: int, width: int, num_bits: int) -> int:
    """Mask of the low `num_bits` bits of every 2 * `width`-byte lane of a word."""
    return sum(((1 << num_bits) - 1) << (16 * width * i) for i in range(word_bytes // (2 * width)))


def _signed(mask: int, dtype: torch.dtype) -> int:
    """An unsigned bit mask as the value of `dtype` with those bits (two's complement)."""
    bits = 8 * dtype.itemsize
    return mask - (1 << bits) if mask >> (bits - 1) else mask
