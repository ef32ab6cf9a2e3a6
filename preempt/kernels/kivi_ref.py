"""KIVI heads' format and torch references (Liu et al. 2024, arXiv 2402.02750): what the
bytes of one `KIVI4`, `KIVI2` or `KIVI_K<k>V<v>` head mean.

Owns: the packed row of one KIVI head, the bit stream of codes of any width
(`_pack_into` / `_unpack_into`), and the torch references `quantize_kivi_ref` /
`dequantize_kivi_ref`, which the Triton kernels (preempt/kernels/kivi_triton.py) and the batched
CPU path (preempt/kernels/kivi_batched.py) match bit for bit (tests/kernels/test_kivi.py). It
never decides the plan (preempt/kernels/plan.py) and never writes the cache.

Format (per head; `preempt.kernels.plan.kivi_layout` gives the byte counts):
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
  rounded to the cache dtype. q * scale is exact in float32 (at most 8 + 11 significant
  bits), so a fused multiply-add gives the same bits as a multiply then an add.
- codes of b bits packed along the channel as a little-endian bit stream: channel c in
  bits [c * b, (c + 1) * b) (4-bit: two per byte, the lower channel in the low bits;
  3-bit: eight codes in three bytes).

Row layout (uint8): full (2, sink + recent, D) cache dtype | K codes (mid, D*b/8) |
V codes (mid, D*b/8) | K params (groups, 2, D) float16 (min row, scale row) |
V params (mid, D / v_group, 2) float16 (min, scale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from preempt.kernels.plan import KiviLayout, kivi_layout

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
