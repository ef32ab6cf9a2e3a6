"""restore_blocks: Triton (interpreter / GPU) == torch reference, and the save->restore
round trip: lossless for FP16 heads, within the E4M3 bound for FP8, zeros for DROP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preempt.kernels.gather_blocks import gather_blocks, gather_blocks_ref
from preempt.kernels.plan import HeadClass, HeadPlan
from preempt.kernels.quantize_heads import (
    QuantizedKV,
    gather_quantize_heads,
    quantize_heads,
    quantize_heads_ref,
)
from preempt.kernels.restore_blocks import dequantize_heads_ref, restore_blocks, restore_blocks_ref
from tests.kernels.conftest import assert_bits_equal, random_cache

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
MIXED = HeadPlan.from_codes([[1, 1, 0, 2], [2, 1, 0, 1], [0, 2, 1, 0]])
OLD = torch.tensor([5, 2, 9, 11, 0, 3, 4, 6, 7, 10])
NEW = torch.tensor([1, 8, 3, 0, 6, 7, 10, 11, 2, 4])


def garbage_like(cache: torch.Tensor) -> torch.Tensor:
    """A cache full of stale, non-zero data: restore must overwrite what it owns."""
    return torch.full_like(cache, 7.0)


def assert_fp8_bound(restored: torch.Tensor, original: torch.Tensor, quantized: QuantizedKV) -> None:
    """Per FP8 head: |x_hat - x| <= 2^-4 |x| (E4M3 keeps 3 mantissa bits, round-to-nearest)
    + 2^-10 * scale (the subnormal step 2^-9 * scale, halved: values this small underflow)
    + the cache dtype's own rounding of the dequantized value."""
    eps = torch.finfo(original.dtype).eps
    slots = quantized.plan.slot_index()
    for layer, head in zip(*quantized.plan.heads_of(HeadClass.FP8), strict=True):
        x = original[layer, :, :, head].double()  # (2, T, D)
        x_hat = restored[layer, :, :, head].double()
        scale = quantized.scales[slots[layer, head]].double()[:, None, None]  # K and V
        bound = (2.0**-4 + eps) * x.abs() + 2.0**-10 * scale + torch.finfo(original.dtype).tiny
        assert ((x_hat - x).abs() <= bound).all(), f"layer {layer} head {head} outside the E4M3 bound"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_ref_bit_exactly(interp, dtype):
    cache = random_cache(3, 12, 4, 4, 16, dtype, device=interp)
    for num_tokens in (37, 40, 1):
        quantized = quantize_heads_ref(gather_blocks_ref(cache, OLD, num_tokens), MIXED)
        out, ref = garbage_like(cache), garbage_like(cache)
        dropped = restore_blocks(quantized, out, NEW, use_triton=True)
        assert torch.equal(dropped, restore_blocks_ref(quantized, ref, NEW))
        assert_bits_equal(out, ref)  # also: blocks outside NEW untouched, tail rows zeroed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_e4m3_byte_decodes_like_torch(interp, dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are never written
    fp8 = codes.view(torch.float8_e4m3fn).reshape(1, 2, 127, 1)
    plan = HeadPlan.all_fp8(1, 1)
    quantized = QuantizedKV(
        plan, 127, 1, dtype, torch.empty(0, 2, 127, 1, dtype=dtype), fp8, torch.tensor([[1.0, 0.375]])
    )
    out, ref = torch.zeros(1, 2, 127, 1, 1, 1, dtype=dtype), torch.zeros(1, 2, 127, 1, 1, 1, dtype=dtype)
    restore_blocks(quantized, out, torch.arange(127), use_triton=True)
    restore_blocks_ref(quantized, ref, torch.arange(127))
    assert_bits_equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_round_trip_is_bit_exact(interp, dtype):
    cache = random_cache(3, 12, 4, 4, 16, dtype, device=interp)
    cache[2, 1, 9, 1, 3, 5] = float("nan")
    plan = HeadPlan.all_fp16(3, 4)
    gathered = gather_blocks(cache, OLD, 37, use_triton=True)
    for quantized in (
        quantize_heads(gathered, plan, use_triton=True),
        gather_quantize_heads(cache, OLD, 37, plan, use_triton=True),
    ):
        out = garbage_like(cache)
        assert not restore_blocks(quantized, out, NEW, use_triton=True).any()
        assert_bits_equal(gather_blocks(out, NEW, 37, use_triton=True), gathered)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_round_trip_bounds_fp8_and_zeroes_dropped_heads(interp, dtype):
    cache = random_cache(3, 12, 4, 4, 16, dtype, seed=2, device=interp)
    original = gather_blocks_ref(cache, OLD, 38)
    quantized = gather_quantize_heads(cache, OLD, 38, MIXED, use_triton=True)
    out = garbage_like(cache)
    dropped = restore_blocks(quantized, out, NEW, use_triton=True)
    assert torch.equal(dropped, MIXED.dropped_mask())
    restored = gather_blocks_ref(out, NEW, 38)
    for layer, head in zip(*MIXED.heads_of(HeadClass.DROP), strict=True):
        assert not restored[layer, :, :, head].any()
    for layer, head in zip(*MIXED.heads_of(HeadClass.FP16), strict=True):
        assert_bits_equal(restored[layer, :, :, head], original[layer, :, :, head])
    assert_fp8_bound(restored, original, quantized)


def test_bad_arguments_are_errors(interp):
    cache = random_cache(3, 12, 4, 4, 16, torch.bfloat16, device=interp)
    quantized = quantize_heads_ref(gather_blocks_ref(cache, OLD, 37), MIXED)
    with pytest.raises(ValueError, match="need 10 block ids"):
        restore_blocks(quantized, cache, NEW[:9], use_triton=True)
    with pytest.raises(ValueError, match="torch.bfloat16 with head_dim 16, the cache torch.float16"):
        restore_blocks(quantized, cache.half(), NEW, use_triton=True)
    with pytest.raises(ValueError, match="the KV cache has 3 x 2"):
        restore_blocks(quantized, cache[:, :, :, :, :2].contiguous(), NEW, use_triton=True)


def _real_kv(num_tokens: int) -> torch.Tensor:
    """KV of the tiny model (small-4l, bf16) after prefilling this repo's README."""
    from preempt.core.config import build_config
    from preempt.core.request import Request
    from preempt.engine.engine import Engine

    config = build_config(
        {
            "model": {"backend": "tiny", "preset": "small-4l", "dtype": "bfloat16", "num_threads": 1},
            "cache": {"block_size": 16, "num_blocks": 64},
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 1024},
        }
    )
    engine = Engine(config)
    prompt = np.frombuffer(b"Preemption in LLM inference serving. " * 30, dtype=np.uint8)[:num_tokens]
    request = Request(0, 0.0, prompt.astype(np.int32), max_tokens=2, target_output_tokens=2, sla_level=0)
    engine.add_request(request)
    engine.step()  # one prefill step fills the cache
    return gather_blocks(engine.runner.kv_cache.kv, request.block_ids, request.num_computed_tokens)


def test_round_trip_on_real_kv_of_the_tiny_model():
    original = _real_kv(512)  # (4, 2, 512, 2, 32), torch path (CPU default)
    num_layers, _, _, num_heads, head_dim = original.shape
    plan = HeadPlan.from_codes([[0, 1], [1, 2], [1, 1], [0, 1]])
    cache = torch.zeros(num_layers, 2, 40, 16, num_heads, head_dim, dtype=original.dtype)
    new = torch.arange(32).flip(0)
    dropped = restore_blocks(quantize_heads(original, plan), cache, new)
    restored = gather_blocks(cache, new, 512)
    assert dropped.tolist() == [[False, False], [False, True], [False, False], [False, False]]
    assert_fp8_bound(restored, original, quantize_heads(original, plan))
    for layer, head in zip(*plan.heads_of(HeadClass.FP8), strict=True):  # measured 2.6-2.8%
        x, x_hat = original[layer, :, :, head].float(), restored[layer, :, :, head].float()
        assert (x_hat - x).norm() / x.norm() < 0.035
    assert_bits_equal(restored[0, :, :, 0], original[0, :, :, 0])


def test_ref_at_a_realistic_size():
    cache = random_cache(8, 80, 16, 8, 128, torch.bfloat16)
    block_ids = torch.randperm(80, generator=torch.Generator().manual_seed(1))
    plan = HeadPlan.random(8, 8, fp8_share=0.6, drop_share=0.1, seed=0)
    original = gather_blocks(cache, block_ids, 1000)
    quantized = quantize_heads(original, plan)
    out = garbage_like(cache)
    restore_blocks(quantized, out, block_ids.flip(0))
    restored = gather_blocks(out, block_ids.flip(0), 1000)
    assert_bits_equal(restored, dequantize_heads_ref(quantized))
    assert_fp8_bound(restored, original, quantized)


@pytest.mark.gpu
def test_compiled_kernel_matches_ref_on_gpu(cuda):
    plan = HeadPlan.random(4, 8, fp8_share=0.5, drop_share=0.2, seed=0)
    for dtype in DTYPES:
        cache = random_cache(4, 300, 16, 8, 128, dtype, device=cuda)
        old, new = torch.randperm(300, device=cuda), torch.randperm(300, device=cuda)
        quantized = gather_quantize_heads(cache, old, 4001, plan)
        out, ref = garbage_like(cache), garbage_like(cache)
        assert torch.equal(restore_blocks(quantized, out, new), restore_blocks_ref(quantized, ref, new))
        assert_bits_equal(out, ref)
        lossless = gather_quantize_heads(cache, old, 4001, HeadPlan.all_fp16(4, 8))
        restore_blocks(lossless, out, new)
        assert_bits_equal(gather_blocks(out, new, 4001), gather_blocks(cache, old, 4001))
