"""Rebuild a request's paged KV from a `QuantizedKV` (docs/design.md §2 restore, §9 mixed precision).

Owns: `_restore_blocks_kernel` and its wrapper `restore_blocks` (dequantize and scatter
into newly allocated blocks, in place), the torch references `restore_blocks_ref` and
`dequantize_heads_ref` (dense (L, 2, T, H, D), for CPU codecs), and the report of dropped
heads. It never allocates blocks (the block pool does) and never masks attention itself:
it returns the (L, H) mask of dropped heads for the caller to hand to attention.

What lands in the cache, per (layer, head), for the first ceil(T / block_size) blocks:
- FP16 heads: the saved bits, unchanged (a lossless round trip is bit-exact).
- FP8 heads: float(e4m3) * scale, rounded half-even to the cache dtype.
- DROP heads: zeros (finite, so 0-weighted attention stays NaN-free), reported dropped.
- token rows past T in the last block: zeros, as the torch saver's restore writes them.

Kernel: one program per ((layer, head, K or V), token tile), no reduction, so tiles run in
parallel. The E4M3 byte is decoded with integer arithmetic and the bf16 result rounded
with an integer round-half-even: Triton's interpreter converts fp8 and bf16 wrongly
(preempt/kernels/dispatch.py), the hardware and torch do not, and this way all three agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from preempt.kernels import dispatch
from preempt.kernels.plan import EXTRA_CLASSES, KIVI_BITS, HeadClass
from preempt.kernels.quantize_heads import QuantizedKV, plan_tables

_TILE_ELEMS = 4096


@triton.jit
def _restore_blocks_kernel(
    dst_ptr,  # integer view of the cache (L, 2, num_blocks, block_size, H, D)
    block_ids_ptr,  # (n,) newly allocated blocks, logical order
    codes_ptr,  # (L*H,) int32 HeadClass per head
    slots_ptr,  # (L*H,) int32 row in its class's packed tensor
    kept_ptr,  # integer view (n_fp16, 2, T, D)
    fp8_ptr,  # uint8 (n_fp8, 2, T, D), E4M3 bytes
    scales_ptr,  # float32 (n_fp8, 2)
    num_tokens,
    padded_tokens,  # n * block_size: rows written, the tail of the last block as zeros
    num_heads,
    block_size,
    head_dim,
    stride_l,
    stride_kv,
    stride_blk,
    stride_tok,
    stride_h,
    DST_KIND: tl.constexpr,  # 0 fp16, 1 bf16, 2 fp32, 3 fp64 (dispatch.DTYPE_KINDS)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # (layer * H + head) * 2 + kv
    kv = pid % 2
    lh = pid // 2
    code = tl.load(codes_ptr + lh)
    slot = tl.load(slots_ptr + lh).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    out_mask = (t < padded_tokens)[:, None] & d_mask[None, :]
    in_mask = (t < num_tokens)[:, None] & d_mask[None, :]
    blk = tl.load(block_ids_ptr + t // block_size, mask=t < padded_tokens, other=0).to(tl.int64)
    rows = (lh // num_heads) * stride_l + kv * stride_kv + (lh % num_heads) * stride_h
    rows += blk * stride_blk + (t % block_size) * stride_tok
    dst = dst_ptr + rows[:, None] + d[None, :]
    src = (slot * 2 + kv) * num_tokens * head_dim + t[:, None] * head_dim + d[None, :]
    if code == 0:  # FP16 class: the saved bits (zeros past T)
        tl.store(dst, tl.load(kept_ptr + src, mask=in_mask, other=0), mask=out_mask)
    elif code == 1:  # FP8 class
        byte = tl.load(fp8_ptr + src, mask=in_mask, other=0).to(tl.int32)  # 0 decodes to +0.0
        exponent = (byte >> 3) & 0xF
        mantissa = byte & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9, exact
        magnitude = tl.where(exponent == 0, subnormal, normal).to(tl.int32, bitcast=True)
        # the sign goes on as a bit: Triton's `-x` is `0 - x`, which turns -0.0 into +0.0
        signed = (magnitude | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)
        value = signed * tl.load(scales_ptr + slot * 2 + kv)
        if DST_KIND == 0:
            bits = value.to(tl.float16).to(tl.int16, bitcast=True)
        elif DST_KIND == 1:  # bf16: round half to even on the 16 dropped bits
            vb = value.to(tl.int32, bitcast=True)
            bits = ((vb + 0x7FFF + ((vb >> 16) & 1)) >> 16).to(tl.int16)
        elif DST_KIND == 2:
            bits = value.to(tl.int32, bitcast=True)
        else:
            bits = value.to(tl.float64).to(tl.int64, bitcast=True)
        tl.store(dst, bits, mask=out_mask)
    else:  # DROP: zeros, built from the kept tensor's integer type
        tl.store(dst, tl.zeros([BLOCK_T, BLOCK_D], dtype=kept_ptr.dtype.element_ty), mask=out_mask)


def restore_blocks(
    quantized: QuantizedKV,
    kv_cache: torch.Tensor,  # (L, 2, num_blocks, block_size, H, D), written in place
    block_ids: torch.Tensor | Sequence[int],  # (n,) newly allocated blocks, n >= ceil(T / bs)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # (L, H) bool, True = dropped head
    """Dequantize `quantized` into the given blocks of `kv_cache`; returns which heads were
    dropped (zeros written), for attention to mask."""
    block_ids = _check(quantized, kv_cache, block_ids)
    if not dispatch.use_triton(kv_cache.device, use_triton):
        return restore_blocks_ref(quantized, kv_cache, block_ids)
    num_layers, _, num_blocks, block_size, num_heads, head_dim = kv_cache.shape
    dispatch.check_block_ids(block_ids, kv_cache.device, num_blocks, "block_ids")
    num_tokens = quantized.num_tokens
    padded_tokens = triton.cdiv(num_tokens, block_size) * block_size
    if padded_tokens:
        dst, kind = dispatch.storage_view(kv_cache)
        kept, _ = dispatch.storage_view(quantized.kept)
        codes, slots = plan_tables(quantized.plan, str(kv_cache.device))
        block_d = triton.next_power_of_2(head_dim)
        block_t = max(1, min(triton.next_power_of_2(padded_tokens), _TILE_ELEMS // block_d))
        grid = (num_layers * num_heads * 2, triton.cdiv(padded_tokens, block_t))
        dispatch.launchable(_restore_blocks_kernel, kv_cache.device)[grid](
            dst,
            block_ids,
            codes,
            slots,
            kept,
            quantized.fp8.view(torch.uint8),
            quantized.scales,
            num_tokens,
            padded_tokens,
            num_heads,
            block_size,
            head_dim,
            dst.stride(0),
            dst.stride(1),
            dst.stride(2),
            dst.stride(3),
            dst.stride(4),
            DST_KIND=kind,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
        )
    if quantized.extra:  # the kernel wrote zeros for these heads; their values go on top
        _scatter_extra(quantized, kv_cache, block_ids)
    return quantized.plan.dropped_mask(kv_cache.device)


def dequantize_extra_ref(quantized: QuantizedKV, cls: HeadClass) -> torch.Tensor:
    """The heads of one `EXTRA_CLASSES` class, dequantized: (n_c, 2, T, D) of the cache dtype."""
    from preempt.kernels.fp8_token import dequantize_fp8_token_ref
    from preempt.kernels.kivi import dequantize_kivi_ref

    rows = quantized.extra[EXTRA_CLASSES.index(cls)]
    if cls == HeadClass.FP8_TOKEN:
        return dequantize_fp8_token_ref(rows, quantized.num_tokens, quantized.head_dim, quantized.dtype)
    bits = KIVI_BITS[cls]
    params = quantized.plan.params()
    return dequantize_kivi_ref(rows, bits, quantized.num_tokens, quantized.head_dim, quantized.dtype, params)


def _scatter_extra(quantized: QuantizedKV, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write the extra classes' dequantized heads into their tokens' slots (torch ops, on
    any device: the dequantization is a few elementwise passes)."""
    num_layers, _, num_blocks, block_size, num_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(num_layers, 2, num_blocks * block_size, num_heads, head_dim)
    t = torch.arange(quantized.num_tokens, device=kv_cache.device)
    slots = block_ids.to(torch.int64)[t // block_size] * block_size + t % block_size  # (T,)
    kv_index = torch.arange(2, device=kv_cache.device)[None, :, None]
    for cls in EXTRA_CLASSES:
        layers, heads = (
            torch.as_tensor(i, device=kv_cache.device)[:, None, None] for i in quantized.plan.heads_of(cls)
        )
        if layers.numel():
            flat[layers, kv_index, slots[None, None, :], heads] = dequantize_extra_ref(quantized, cls)


def _check(quantized: QuantizedKV, kv_cache: torch.Tensor, block_ids) -> torch.Tensor:
    dispatch.check_kv_cache(kv_cache)
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    quantized.plan.check_shape(num_layers, num_heads)
    if quantized.dtype != kv_cache.dtype or quantized.head_dim != head_dim:
        raise ValueError(
            f"saved KV is {quantized.dtype} with head_dim {quantized.head_dim}, "
            f"the cache {kv_cache.dtype} with head_dim {head_dim}"
        )
    for name in ("kept", "fp8", "scales"):
        tensor = getattr(quantized, name)
        if tensor.device != kv_cache.device or not tensor.is_contiguous():
            raise ValueError(f"quantized.{name} must be contiguous on {kv_cache.device} (use .to(device))")
    if any(t.device != kv_cache.device for t in quantized.extra):
        raise ValueError(f"quantized.extra must be on {kv_cache.device} (use .to(device))")
    block_ids = torch.as_tensor(block_ids, device=kv_cache.device)
    needed = triton.cdiv(quantized.num_tokens, block_size)
    if block_ids.ndim != 1 or block_ids.numel() < needed:
        raise ValueError(
            f"{quantized.num_tokens} tokens need {needed} block ids, got {tuple(block_ids.shape)}"
        )
    return block_ids[:needed]


def dequantize_heads_ref(quantized: QuantizedKV, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense KV (L, 2, T, H, D) from a `QuantizedKV`: FP16 heads as saved, FP8 heads
    dequantized, dropped heads zero. What a CPU codec decodes to (the saver's existing
    restore then applies). `out`: an (L, 2, T, H, D) tensor (or view) to fill; every
    element is written.

    CPU speed: a mostly-KIVI plan's KIVI heads are dequantized together
    (`kivi.dequantize_kivi_kv`, writing every head in place, so the other classes come
    after it), and each class's heads go in by one copy per head (a strided (2, T, D)
    copy; an advanced-index assignment runs ~10x slower here)."""
    from preempt.kernels.kivi import KiviClass, dequantize_kivi_kv

    plan = quantized.plan
    device = quantized.kept.device
    shape = (plan.num_layers, 2, quantized.num_tokens, plan.num_kv_heads, quantized.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=quantized.dtype, device=device)
    done = set()
    kivi = [cls for cls in KIVI_BITS if quantized.extra and plan.count(cls)]
    if 2 * sum(plan.count(cls) for cls in kivi) >= plan.num_layers * plan.num_kv_heads:
        classes = [KiviClass(*plan.heads_of(cls), KIVI_BITS[cls]) for cls in kivi]
        rows = [quantized.extra[EXTRA_CLASSES.index(cls)] for cls in kivi]
        dequantize_kivi_kv(rows, classes, plan.params(), out)
        done.update(kivi)
    _put_heads(out, plan.heads_of(HeadClass.FP16), quantized.kept)
    fp8 = dequantize_fp8_ref(quantized.fp8, quantized.scales, quantized.dtype)
    _put_heads(out, plan.heads_of(HeadClass.FP8), fp8)
    for cls in EXTRA_CLASSES if quantized.extra else ():
        if cls not in done and plan.count(cls):
            _put_heads(out, plan.heads_of(cls), dequantize_extra_ref(quantized, cls))
    for layer, head in zip(*plan.heads_of(HeadClass.DROP), strict=True):
        out[layer, :, :, head].zero_()
    return out


def _put_heads(out: torch.Tensor, heads: tuple, values: torch.Tensor) -> None:
    """out[layer, :, :, head] = values[i] for the i-th (layer, head) of `heads`."""
    for i, (layer, head) in enumerate(zip(*heads, strict=True)):
        out[layer, :, :, head] = values[i]


_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code -> value


def dequantize_fp8_ref(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2, T, D) E4M3 and (n, 2) scales -> (float32(fp8) * scale).to(dtype), (n, 2, T, D).

    Through a 256-entry table per (head, K or V) holding exactly those products, already
    rounded to `dtype`: same bits as the formula, ~2x faster on CPU, where torch's fp8
    upcast runs at ~0.14 G elements/s on one core."""
    num_rows = fp8.shape[0] * 2
    out = torch.empty(fp8.shape, dtype=dtype, device=fp8.device)
    if out.numel() == 0:
        return out
    tables = (_E4M3_VALUES.to(fp8.device)[None, :] * scales.reshape(num_rows, 1)).to(dtype)  # (rows, 256)
    codes = fp8.view(torch.uint8).reshape(num_rows, -1).to(torch.int32)
    flat = out.view(num_rows, -1)
    for row in range(num_rows):
        torch.index_select(tables[row], 0, codes[row], out=flat[row])
    return out


def restore_blocks_ref(
    quantized: QuantizedKV, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:  # (L, H) bool, True = dropped head
    """Torch reference (and the CPU path) of `restore_blocks`: same bytes in the cache."""
    block_ids = _check(quantized, kv_cache, block_ids)
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    num_blocks = block_ids.numel()
    padded = kv_cache.new_empty(num_layers, 2, num_blocks * block_size, num_heads, head_dim)
    dequantize_heads_ref(quantized, out=padded[:, :, : quantized.num_tokens])
    padded[:, :, quantized.num_tokens :] = 0  # the last block's rows past T
    blocks = padded.view(num_layers, 2, num_blocks, block_size, num_heads, head_dim)
    kv_cache.index_copy_(2, block_ids.to(torch.int64), blocks)
    return quantized.plan.dropped_mask(kv_cache.device)
