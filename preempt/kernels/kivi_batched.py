"""The batched CPU path of KIVI heads: every KIVI head of a request at once, whatever
its class.

Owns: `KiviClass` (one class's heads and bits), `quantize_kivi_kv` / `dequantize_kivi_kv`
(the same bytes and values as `quantize_kivi_ref` / `dequantize_kivi_ref` of each class's
heads, tested), their word-parallel packing `_pack_codes` / `_unpack_codes` (the bit
stream of preempt/kernels/kivi_ref.py), and the per-thread scratch buffers they reuse.
`quantize_heads_ref` and `dequantize_heads_ref` take this path for mostly-KIVI plans. Why
it batches, chunks and keeps buffers: the functions' docstrings and docs/codec.md ("How the
CPU path gets there", with the speeds).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from preempt.kernels.kivi_ref import HALF_MAX, MIN_SCALE, ROUNDER, _copy_low_bytes, _sections, _unit
from preempt.kernels.plan import kivi_layout

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
    contiguous, of `kivi_ref._pack_into` (same bytes), by halving steps inside machine words
    instead of a shift per code: the codes of one whole-byte run (`_unit`: 2, 4 or 8 codes)
    are one little-endian int16/32/64 word, and each step merges neighbouring lanes,
    (even lane) | (odd lane) >> (8 - bits) * width, width 1, 2, then 4 bytes; after
    log2(codes per run) steps the word's low bytes are the run's stream. 1, 2 and 4 bits
    (one byte per run) keep it by a narrowing integer conversion, which keeps the low byte;
    3, 5, 6 and 7 bits by a byte copy. Every step is a contiguous elementwise op on whole
    words."""
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
    """(n, ..., D * bits / 8) bit stream (`kivi_ref._pack_into`), rows contiguous -> the
    codes into `out` (n, ..., D) uint8, contiguous: `_pack_codes` backwards. Each run's
    bytes go into the low bytes of one word (a widening conversion for one-byte runs, a byte
    copy for the others), then halving steps in reverse split each lane into two, the odd
    half moved up by (8 - bits) * width bits, width 4, 2, then 1 byte."""
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
