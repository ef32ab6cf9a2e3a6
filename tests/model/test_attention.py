"""Paged attention against a dense causal reference, and the metadata it runs on."""

from __future__ import annotations

import math

import pytest
import torch

from preempt.model.attention import (
    _decode_attention_16bit,
    build_attention_metadata,
    paged_attention,
    write_kv,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q (n, Hq, D) at positions start.. ; k, v (S, Hkv, D) for positions 0..S-1 -> (n, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])  # (Hq, n, S)
    positions = start + torch.arange(q.shape[0])
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]  # (n, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def run_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    seed: int,
    decode_group_bytes: int,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs: (start, num_new) per sequence. Returns (paged, reference) outputs (T, Hq, D):
    paged attention in `dtype`, the reference in float64 over the same (rounded) values."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in seqs) + 7
    # Scattered, non-contiguous physical blocks; block 0 is used too (it is also the padding id).
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    block_ids, ks, vs, qs = [], [], [], []
    for start, num_new in seqs:
        nb = -(-(start + num_new) // block_size)
        # Some sequences hold more blocks than they need (allocated ahead by a scheduler).
        extra = 1 if len(block_ids) % 2 else 0
        block_ids.append([physical.pop() for _ in range(nb + extra)])
        for out, shape in (
            (ks, (start + num_new, NUM_KV_HEADS)),
            (vs, (start + num_new, NUM_KV_HEADS)),
            (qs, (num_new, NUM_HEADS)),
        ):
            # rounded to `dtype`, so the float64 reference sees the values paged attention does
            out.append(torch.randn(*shape, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype).double())
    # The cached prefix [0, start) was written by earlier steps.
    prefix = build_attention_metadata([0] * len(seqs), [s + n for s, n in seqs], block_ids, block_size)
    write_kv(k_cache, v_cache, prefix.slot_mapping, torch.cat(ks), torch.cat(vs))
    meta = build_attention_metadata(
        [s for s, _ in seqs],
        [n for _, n in seqs],
        block_ids,
        block_size,
        kv_bytes_per_token_per_layer=2 * NUM_KV_HEADS * HEAD_DIM * 8,
        decode_group_bytes=decode_group_bytes,
    )
    out = paged_attention(torch.cat(qs).to(dtype), k_cache, v_cache, meta, 1.0 / math.sqrt(HEAD_DIM))
    ref = torch.cat([dense_causal(q, k, v, s) for q, k, v, (s, _) in zip(qs, ks, vs, seqs, strict=True)])
    return out, ref


MIXED = [(0, 9), (12, 1), (5, 1), (0, 1), (30, 7), (17, 1), (3, 4), (40, 1), (1, 1)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("decode_group_bytes", [1, 1 << 30])  # one sequence per group / one group
def test_mixed_batch_matches_dense(block_size: int, decode_group_bytes: int) -> None:
    out, ref = run_case(MIXED, block_size, seed=block_size, decode_group_bytes=decode_group_bytes)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 33)],  # one prompt, no prefix: the is_causal path
        [(16, 16)],  # prompt chunk starting on a block boundary
        [(5, 1), (5, 1), (5, 1)],  # equal decode lengths: no mask needed
        [(63, 1), (0, 1), (31, 1), (64, 1)],  # very different decode lengths: padded, masked
    ],
)
def test_edge_shapes_match_dense(seqs: list[tuple[int, int]]) -> None:
    out, ref = run_case(seqs, block_size=8, seed=1, decode_group_bytes=4 << 20)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_decode_matches_dense_within_rounding(dtype: torch.dtype) -> None:
    # 16-bit decode on CPU takes its own grouped-matmul path (not SDPA): padded groups of
    # different lengths, GQA, and prefill beside it.
    out, ref = run_case(MIXED, block_size=4, seed=3, decode_group_bytes=1 << 30, dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2 * torch.finfo(dtype).eps)


def test_slot_mapping_and_indices() -> None:
    block_size = 4
    block_ids = [[7, 2, 9], [5], [3, 8]]
    meta = build_attention_metadata([2, 0, 6], [5, 3, 1], block_ids, block_size)
    expected_slots, expected_positions = [], []
    for (start, num_new), ids in zip([(2, 5), (0, 3), (6, 1)], block_ids, strict=True):
        for p in range(start, start + num_new):
            expected_positions.append(p)
            expected_slots.append(ids[p // block_size] * block_size + p % block_size)
    assert meta.slot_mapping.tolist() == expected_slots
    assert meta.positions.tolist() == expected_positions
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9]
    assert meta.seq_lens.tolist() == [7, 3, 7]
    assert meta.logits_indices.tolist() == [4, 7, 8]
    assert meta.block_tables.tolist() == [[7, 2], [5, 0], [3, 8]]
    assert meta.slot_mapping.dtype == torch.int64
    assert len(meta.prefill_chunks) == 2 and len(meta.decode_groups) == 1


def test_too_few_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_attention_metadata([4], [5], [[0, 1]], 4)


def test_write_kv_places_tokens_at_slots() -> None:
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    write_kv(k_cache, v_cache, torch.tensor([5, 0, 3]), k, -k)
    flat = k_cache.view(-1, 1, 2)
    assert (
        flat[5].tolist() == [[0.0, 1.0]]
        and flat[0].tolist() == [[2.0, 3.0]]
        and flat[3].tolist() == [[4.0, 5.0]]
    )
    torch.testing.assert_close(v_cache, -k_cache)


@pytest.mark.parametrize("per_head", [False, True])
def test_16bit_decode_masks_like_sdpa(per_head: bool) -> None:
    # The masks decode meets: padding (n, 1, 1, L) and a lossy restore's per-head prefixes
    # (n, Hq, 1, L); query head h reads KV head h // group, as SDPA's enable_gqa.
    gen = torch.Generator().manual_seed(0)
    n, length = 3, 37
    q = torch.randn(n, NUM_HEADS, 1, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(n, NUM_KV_HEADS, length, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(n, NUM_KV_HEADS, length, HEAD_DIM, generator=gen).bfloat16()
    mask = torch.rand(n, NUM_HEADS if per_head else 1, 1, length, generator=gen) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3, enable_gqa=True
    )
    out = _decode_attention_16bit(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps)
