"""quantize_heads: Triton (interpreter / GPU) == torch reference, bit for bit, FP8 included.

FP8 is compared bit-exactly, not within a tolerance: the kernel rounds to E4M3 itself
(integer round-half-even on the fp32 mantissa, see kernels/quantize_heads.py) instead of
using Triton's fp8 cast, which the interpreter gets wrong for ~2.5% of values (the last
test here shows that bug while it lasts). So a mismatch in any bit is a real bug.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from preempt.kernels.gather_blocks import gather_blocks_ref
from preempt.kernels.plan import HeadClass, HeadPlan, bytes_per_token, scale_bytes
from preempt.kernels.quantize_heads import (
    gather_quantize_heads,
    gather_quantize_heads_ref,
    quantize_heads,
    quantize_heads_ref,
)
from tests.kernels.conftest import assert_bits_equal, random_cache

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
MIXED = HeadPlan.from_codes([[1, 1, 0, 2], [2, 1, 0, 1], [0, 2, 1, 0]])


def assert_same(actual, expected) -> None:
    assert (actual.num_tokens, actual.head_dim, actual.dtype, actual.plan) == (
        expected.num_tokens,
        expected.head_dim,
        expected.dtype,
        expected.plan,
    )
    for name in ("kept", "fp8", "scales"):
        assert_bits_equal(getattr(actual, name), getattr(expected, name))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_ref_bit_exactly(interp, dtype):
    kv = random_cache(3, 1, 37, 4, 16, dtype, device=interp)[:, :, 0]  # (L, 2, T, H, D)
    assert_same(quantize_heads(kv, MIXED, use_triton=True), quantize_heads_ref(kv, MIXED))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gather_matches_ref(interp, dtype):
    cache = random_cache(3, 12, 4, 4, 16, dtype, seed=1, device=interp)
    block_ids = torch.tensor([5, 2, 9, 11, 0, 3, 4, 6, 7, 10], device=interp)
    for num_tokens in (37, 40, 3):
        out = gather_quantize_heads(cache, block_ids, num_tokens, MIXED, use_triton=True)
        assert_same(out, quantize_heads_ref(gather_blocks_ref(cache, block_ids, num_tokens), MIXED))


def test_packed_layout(interp):
    kv = random_cache(3, 1, 9, 4, 8, torch.bfloat16, device=interp)[:, :, 0]
    out = quantize_heads(kv, MIXED, use_triton=True)
    assert out.kept.shape == (MIXED.num_fp16, 2, 9, 8) and out.fp8.shape == (MIXED.num_fp8, 2, 9, 8)
    assert out.scales.shape == (MIXED.num_fp8, 2) and out.fp8.dtype == torch.float8_e4m3fn
    slots = MIXED.slot_index()
    for layer, head in zip(*MIXED.heads_of(HeadClass.FP16), strict=True):
        assert_bits_equal(out.kept[slots[layer, head]], kv[layer, :, :, head])
    for layer, head in zip(*MIXED.heads_of(HeadClass.FP8), strict=True):
        amax = kv[layer, :, :, head].float().abs().amax(dim=(1, 2))  # K and V
        assert torch.equal(out.scales[slots[layer, head]], amax / 448)
    assert out.nbytes == 4 * 2 * 9 * 8 * 2 + 5 * 2 * 9 * 8 + 5 * 2 * 4


def _e4m3_edge_values() -> torch.Tensor:
    """Every finite E4M3 magnitude, every midpoint between neighbours (the ties), one fp32
    ulp either side of each midpoint, values that flush to zero, with both signs."""
    grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-10, 1e-30, 0.0])
    values = torch.cat([grid, mids, near, tiny])
    return torch.cat([values, -values])


def test_fp8_rounding_is_bit_exact_on_every_edge(interp):
    values = _e4m3_edge_values()
    num_tokens = -(-values.numel() // 4)
    x = torch.zeros(num_tokens * 4)
    x[: values.numel()] = values
    x[-1] = 448.0  # amax 448 -> scale exactly 1, so the kernel sees the values themselves
    kv = x.view(1, 1, num_tokens, 1, 4).expand(1, 2, num_tokens, 1, 4).contiguous()
    plan = HeadPlan.all_fp8(1, 1)
    out = quantize_heads(kv, plan, use_triton=True)
    assert out.scales.tolist() == [[1.0, 1.0]]
    assert_bits_equal(out.fp8, kv.permute(3, 1, 2, 0, 4).reshape(1, 2, num_tokens, 4).to(torch.float8_e4m3fn))


def test_zero_heads_and_empty_requests(interp):
    kv = torch.zeros(1, 2, 5, 2, 4, dtype=torch.float16)
    out = quantize_heads(kv, HeadPlan.all_fp8(1, 2), use_triton=True)
    assert out.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]] and not out.fp8.float().any()
    empty = quantize_heads(kv[:, :, :0], HeadPlan.all_fp8(1, 2), use_triton=True)
    assert empty.fp8.shape == (2, 2, 0, 4) and empty.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert_same(empty, quantize_heads_ref(kv[:, :, :0], HeadPlan.all_fp8(1, 2)))
    dropped = quantize_heads(kv, HeadPlan.uniform(1, 2, HeadClass.DROP), use_triton=True)
    assert dropped.nbytes == 0


def test_plan_must_fit_the_cache(interp):
    kv = torch.zeros(2, 2, 3, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the KV cache has 2 x 4"):
        quantize_heads(kv, HeadPlan.all_fp8(2, 2), use_triton=True)


def test_ref_at_a_realistic_size():
    # 8 layers of a Llama-3-8B-like cache (8 KV heads x 128), 512 tokens, torch only.
    kv = random_cache(8, 1, 512, 8, 128, torch.bfloat16)[:, :, 0]
    plan = HeadPlan.random(8, 8, fp8_share=0.6, drop_share=0.1, seed=0)
    out = quantize_heads(kv, plan)  # CPU default: the torch path
    slots = plan.slot_index()
    layer, head = (int(i[0]) for i in plan.heads_of(HeadClass.FP16))
    assert_bits_equal(out.kept[slots[layer, head]], kv[layer, :, :, head])
    assert out.nbytes == bytes_per_token(plan, 128, torch.bfloat16) * 512 + scale_bytes(plan)


def test_fused_ref_equals_gather_then_quantize():
    plan = HeadPlan.random(4, 8, fp8_share=0.5, drop_share=0.2, seed=2)
    cache = random_cache(4, 40, 16, 8, 64, torch.bfloat16)
    block_ids = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    for view, num_tokens in ((cache, 600), (cache[:, :, :, :8], 300)):  # the slice: blocks do not merge
        expected = quantize_heads_ref(gather_blocks_ref(view, block_ids, num_tokens), plan)
        assert_same(gather_quantize_heads_ref(view, block_ids, num_tokens, plan), expected)
        assert_same(gather_quantize_heads(view, block_ids, num_tokens, plan), expected)


@triton.jit
def _plain_fp8_cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x.to(tl.float8e4nv), mask=offs < n)


def test_interpreter_fp8_cast_bug_is_why_the_kernel_rounds_itself(interp):
    """Not a test of our code: documents the trap. Skips once Triton fixes it."""
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100).clamp(-448, 448)
    out = torch.empty(4096, dtype=torch.float8_e4m3fn)
    _plain_fp8_cast[(1,)](x, out, 4096, BLOCK=4096)
    wrong = out.view(torch.uint8) != x.to(torch.float8_e4m3fn).view(torch.uint8)
    if not wrong.any():
        pytest.skip("this Triton's interpreter casts to fp8 correctly")
    assert 0.005 < wrong.float().mean() < 0.05  # ~2.5%: rounded up to 2^k in torch, 2^(k-1) here
    assert torch.equal(out[wrong].float().abs() * 2, x[wrong].to(torch.float8_e4m3fn).float().abs())


@pytest.mark.gpu
def test_compiled_kernel_matches_ref_on_gpu(cuda):
    plan = HeadPlan.random(4, 8, fp8_share=0.5, drop_share=0.2, seed=0)
    for dtype in DTYPES:
        cache = random_cache(4, 300, 16, 8, 128, dtype, device=cuda)
        block_ids = torch.randperm(300, device=cuda)
        out = gather_quantize_heads(cache, block_ids, 4001, plan)
        assert_same(out, quantize_heads_ref(gather_blocks_ref(cache, block_ids, 4001), plan))
    values = _e4m3_edge_values().to(cuda)
    kv = torch.cat([values, torch.tensor([448.0], device=cuda)]).view(1, 1, -1, 1, 1).expand(1, 2, -1, 1, 1)
    out = quantize_heads(kv.contiguous(), HeadPlan.all_fp8(1, 1))
    assert_bits_equal(out.fp8.reshape(2, -1)[0], kv[0, 0, :, 0, 0].to(torch.float8_e4m3fn))
