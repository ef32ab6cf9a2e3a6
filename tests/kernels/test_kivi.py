"""KIVI heads and FP8 per-token heads: Triton kernels bit-exact against the torch
references under the interpreter (and on CUDA), the references' error bounds, exact
sink/recent tokens, bit packing of every width, and the whole path through the codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preempt.kernels.fp8_token import dequantize_fp8_token_ref, quantize_fp8_token, quantize_fp8_token_ref
from preempt.kernels.kivi import dequantize_kivi_ref, quantize_kivi, quantize_kivi_ref
from preempt.kernels.kivi_ref import _pack, _unpack
from preempt.kernels.plan import KIVI_BITS, HeadClass, HeadPlan, kivi_layout, stored_bytes
from preempt.kernels.quantize_heads import gather_quantize_heads, quantize_heads
from preempt.kernels.restore_blocks import dequantize_heads_ref, restore_blocks
from tests.kernels.conftest import assert_bits_equal

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _heads(dtype, num_tokens=45, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.rand(head_dim, generator=gen) * 8 + 0.1  # outlier-ish channels
    x = torch.randn(3, 2, num_tokens, head_dim, generator=gen) * channel_scale
    return x.to(dtype)


@pytest.mark.parametrize("bits", [(4, 4), (2, 2), (8, 4), (5, 4), (6, 4), (5, 3), (3, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_kernel_matches_reference_bit_exactly(interp, dtype, bits):
    """Whole codes per byte (2/4/8 bits) in the quantizing kernels; 3/5/6/7 bits through
    the codes kernels and the pack kernel, codes straddling bytes."""
    x = _heads(dtype)
    for params in ((16, 3, 5), (8, 0, 0)):
        assert_bits_equal(quantize_kivi(x, bits, params, use_triton=True), quantize_kivi_ref(x, bits, params))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_token_kernel_matches_reference_bit_exactly(interp, dtype):
    x = _heads(dtype)
    x[1, 0, 3] = 0  # an all-zero token takes scale 1.0
    assert_bits_equal(quantize_fp8_token(x, use_triton=True), quantize_fp8_token_ref(x))


def test_kernels_on_cuda_match_reference(cuda):
    x = _heads(torch.bfloat16, num_tokens=300, head_dim=128).to(cuda)
    for bits in ((4, 4), (2, 2), (8, 4), (5, 4), (6, 4), (5, 3)):
        assert_bits_equal(
            quantize_kivi(x, bits, (32, 4, 32)).cpu(), quantize_kivi_ref(x.cpu(), bits, (32, 4, 32))
        )
    assert_bits_equal(quantize_fp8_token(x).cpu(), quantize_fp8_token_ref(x.cpu()))


@pytest.mark.parametrize("num_bits", range(1, 9))
def test_bit_packing_round_trips_every_width(num_bits):
    codes = torch.randint(0, 2**num_bits, (5, 16), dtype=torch.uint8)
    packed = _pack(codes, num_bits)
    assert packed.shape == (5, 16 * num_bits // 8)
    assert torch.equal(_unpack(packed, num_bits), codes)


@pytest.mark.parametrize("bits", [(4, 4), (2, 2), (5, 4), (6, 4), (8, 4), (5, 3)])
def test_kivi_round_trip_error_bound_and_exact_sink_and_recent(bits):
    x = _heads(torch.float32)
    params = (16, 3, 5)
    rows = quantize_kivi_ref(x, bits, params)
    assert rows.shape == (3, kivi_layout(bits, 45, 16, 4, params).nbytes)
    back = dequantize_kivi_ref(rows, bits, 45, 16, torch.float32, params)
    assert torch.equal(back[:, :, :3], x[:, :, :3]) and torch.equal(back[:, :, -5:], x[:, :, -5:])
    mid = slice(3, 40)
    # per element: half a step of its group (float16 params add a little) and no more
    keys = x[:, 0, mid].reshape(3, -1, 16)  # groups of up to 16 tokens per channel
    k_step = (x[:, 0, mid].amax(1) - x[:, 0, mid].amin(1)) / (2 ** bits[0] - 1)  # <= each group's step
    assert ((back[:, 0, mid] - x[:, 0, mid]).abs() <= 0.51 * k_step[:, None] + 1e-3 * keys.abs().amax()).all()
    v_step = (x[:, 1, mid].amax(-1) - x[:, 1, mid].amin(-1)) / (2 ** bits[1] - 1)  # one group = D channels
    assert ((back[:, 1, mid] - x[:, 1, mid]).abs() <= 0.51 * v_step[..., None] + 1e-3).all()


def test_kivi_short_requests_keep_everything():
    x = _heads(torch.bfloat16, num_tokens=6)
    back = dequantize_kivi_ref(
        quantize_kivi_ref(x, (2, 2), (16, 4, 4)), (2, 2), 6, 16, torch.bfloat16, (16, 4, 4)
    )
    assert_bits_equal(back, x)


def test_fp8_token_round_trip_is_within_e4m3_rounding():
    x = _heads(torch.float32)
    back = dequantize_fp8_token_ref(quantize_fp8_token_ref(x), 45, 16, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert ((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale).all()


def test_mixed_plan_of_every_class_restores_through_paged_blocks(interp):
    """Every class in one plan: fused gather + quantize (reference and Triton) agree,
    restore (reference and Triton) writes the same cache, and sizes match stored_bytes."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, 9, 8, 5, 16, generator=gen).to(torch.bfloat16)  # (L, 2, N, bs, H, D)
    codes = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    plan = HeadPlan.from_codes(codes, params=(8, 2, 3))
    block_ids = torch.tensor([4, 0, 7, 2, 5])
    ref = gather_quantize_heads(cache, block_ids, 37, plan)
    tri = gather_quantize_heads(cache, block_ids, 37, plan, use_triton=True)
    for a, b in zip(
        (ref.kept, ref.fp8, ref.scales, *ref.extra), (tri.kept, tri.fp8, tri.scales, *tri.extra), strict=True
    ):
        assert_bits_equal(a, b)
    assert ref.nbytes == stored_bytes(plan, 37, 16, torch.bfloat16)
    dense = dequantize_heads_ref(ref)
    assert dense.shape == (2, 2, 37, 5, 16)
    out_ref, out_tri = torch.full_like(cache, 3.0), torch.full_like(cache, 3.0)
    dst = [1, 3, 6, 8, 0]
    mask = restore_blocks(ref, out_ref, dst)
    restore_blocks(ref, out_tri, dst, use_triton=True)
    assert_bits_equal(out_ref, out_tri)
    assert mask.tolist() == [[False, False, True, False, False], [False] * 5]
    assert torch.equal(out_ref[:, :, 0, 5:], torch.zeros_like(out_ref[:, :, 0, 5:]))  # tail past T
    # the dense path of the same plan gives the same packed heads
    flat = quantize_heads(_gathered(cache, block_ids, 37), plan)
    assert all(torch.equal(a, b) for a, b in zip(flat.extra, ref.extra, strict=True))
    assert HeadClass.KIVI_K5V4 in {c for row in plan.classes for c in row}


def _gathered(cache, block_ids, num_tokens):
    from preempt.kernels.gather_blocks import gather_blocks_ref

    return gather_blocks_ref(cache, block_ids, num_tokens)


@pytest.mark.parametrize("blocks", [False, True, "spans"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, params", [((3, 77, 5, 16), (16, 3, 5)), ((2, 130, 3, 24), (32, 4, 32)), ((2, 9, 2, 8), (8, 4, 4))]
)
def test_batched_kivi_equals_the_per_class_reference(monkeypatch, dtype, shape, params, blocks):
    """quantize_kivi_kv (every head of the request at once, per-head levels) writes the
    same bytes as quantize_kivi_ref of each class's heads, for every bit width, short
    last key groups, outlier channels, a flat group and out-of-range codes included.
    `blocks`: buffers so small that every layer is its own block, cut into spans of one
    key group, each quantized in chunks of one group (True), or into spans of two groups
    quantized at once ("spans"): a served model's long request takes that path; and one
    class's heads in shuffled slot order (its rows of a block are then not consecutive)."""
    import preempt.kernels.kivi_batched as kivi_batched
    from preempt.kernels.kivi import KiviClass, quantize_kivi_kv

    num_layers, num_tokens, num_heads, head_dim = shape
    if blocks is True:
        monkeypatch.setattr(kivi_batched, "_BATCH_ELEMS", 1)  # one key group of tokens per chunk
        monkeypatch.setattr(kivi_batched, "_SCRATCH_MAX_BYTES", 1)  # one layer and one group per block
    elif blocks == "spans":  # one layer per block, blocks of two key groups' codes
        monkeypatch.setattr(kivi_batched, "_SCRATCH_MAX_BYTES", 2 * params[0] * num_heads * head_dim)
    gen = torch.Generator().manual_seed(num_tokens)
    kv = torch.randn(num_layers, 2, num_tokens, num_heads, head_dim, generator=gen)
    kv = (kv * (torch.rand(head_dim, generator=gen) * 8 + 0.1)).to(dtype)
    kv[0, :, 10:40, 0] = 3.0  # a flat head: scale floored at 2^-14
    kv[-1, 0, 5:20, -1] += 1000.0  # a large offset: float16 min far from every value
    bits = [(4, 4), (2, 2), (5, 4), (6, 4), (8, 4), (5, 3), (3, 6), (1, 7)]
    bits = [b for b in bits if head_dim * b[0] % 8 == 0 and head_dim * b[1] % 8 == 0]
    rng = np.random.default_rng(0)
    which = rng.integers(0, len(bits), (num_layers, num_heads))
    if blocks:
        which[:, :2] = 0  # two heads of one class in every layer (block)
    classes = [KiviClass(*np.nonzero(which == i), b) for i, b in enumerate(bits) if (which == i).any()]
    if blocks:
        order = rng.permutation(len(classes[0].layers))
        classes[0] = classes[0]._replace(layers=classes[0].layers[order], heads=classes[0].heads[order])
    for c, rows in zip(classes, quantize_kivi_kv(kv, classes, params), strict=True):
        views = [kv[layer, :, :, head] for layer, head in zip(c.layers, c.heads, strict=True)]
        assert_bits_equal(rows, quantize_kivi_ref(views, c.bits, params))


def test_quantize_heads_ref_takes_the_batched_path_for_kivi_plans(monkeypatch):
    """A mostly-KIVI plan goes through quantize_kivi_kv (checked by breaking the per-class
    reference for any non-empty class) and packs the same rows as the per-class reference."""
    import preempt.kernels.kivi_triton as kivi_triton  # quantize_kivi looks the reference up there
    from preempt.kernels.plan import EXTRA_CLASSES

    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 2, 70, 3, 16, generator=gen)
    plan = HeadPlan.from_codes(np.array([[4, 6, 7], [8, 0, 9]]), params=(16, 4, 8))
    expected = {
        cls: quantize_kivi_ref([kv[la, :, :, h] for la, h in zip(*plan.heads_of(cls), strict=True)],
                               KIVI_BITS[cls], plan.params())
        for cls in KIVI_BITS if plan.count(cls)
    }  # fmt: skip
    reference = kivi_triton.quantize_kivi_ref

    def only_empty(selected, *args):
        assert len(selected) == 0, "the per-class reference ran on a KIVI class"
        return reference(selected, *args)

    monkeypatch.setattr(kivi_triton, "quantize_kivi_ref", only_empty)
    got = dict(zip(EXTRA_CLASSES, quantize_heads(kv, plan, use_triton=False).extra, strict=True))
    for cls, rows in expected.items():
        assert_bits_equal(got[cls], rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_kivi_decode_equals_the_per_class_reference(dtype):
    """dequantize_kivi_kv writes each class's heads as dequantize_kivi_ref decodes them,
    and dequantize_heads_ref of a mostly-KIVI plan (other classes and a dropped head
    written after it) equals the per-class assembly."""
    from preempt.kernels.kivi import KiviClass, dequantize_kivi_kv, quantize_kivi_kv

    gen = torch.Generator().manual_seed(5)
    kv = (torch.randn(3, 2, 77, 4, 16, generator=gen) * 3).to(dtype)
    params = (16, 3, 5)
    which = np.array([[4, 6, 7, 9], [8, 5, 4, 6], [0, 2, 1, 3]])
    plan = HeadPlan.from_codes(which, params=params)
    classes = [KiviClass(*plan.heads_of(HeadClass(c)), KIVI_BITS[HeadClass(c)]) for c in (4, 5, 6, 7, 8, 9)]
    rows = quantize_kivi_kv(kv, classes, params)
    out = torch.full_like(kv, 7.0)
    dequantize_kivi_kv(rows, classes, params, out)
    for c, r in zip(classes, rows, strict=True):
        back = dequantize_kivi_ref(r, c.bits, 77, 16, dtype, params)
        for i, (layer, head) in enumerate(zip(c.layers, c.heads, strict=True)):
            assert_bits_equal(out[layer, :, :, head], back[i])
    quantized = quantize_heads(kv, plan, use_triton=False)
    dense = dequantize_heads_ref(quantized)
    for cls in HeadClass:
        for layer, head in zip(*plan.heads_of(cls), strict=True):
            if cls == HeadClass.DROP:
                assert not dense[layer, :, :, head].any()
            elif cls == HeadClass.FP16:
                assert_bits_equal(dense[layer, :, :, head], kv[layer, :, :, head])
    assert_bits_equal(dense[:2], out[:2])  # the KIVI layers as the batched decode wrote them


def test_kivi_rows_at_an_odd_offset_decode():
    """One row whose float16 params start at an odd byte (a one-head class after sections
    of odd length in a blob) decodes; it raised: the row is contiguous, so it was not
    copied, and a float16 view of an odd offset is refused."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 21, 24, generator=gen).half()
    rows = quantize_kivi_ref(x, (5, 3), (8, 0, 0))
    padded = torch.zeros(1, rows.shape[1] + 1, dtype=torch.uint8)
    padded[0, 1:] = rows[0]
    view = padded[:, 1:]  # contiguous, at an odd storage offset
    assert view.is_contiguous() and view.storage_offset() % 2 == 1
    back = dequantize_kivi_ref(view, (5, 3), 21, 24, torch.float16, (8, 0, 0))
    assert_bits_equal(back, dequantize_kivi_ref(rows, (5, 3), 21, 24, torch.float16, (8, 0, 0)))
