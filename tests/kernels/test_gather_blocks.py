"""gather_blocks: Triton (interpreter / GPU) == torch reference == the saver's gather."""

from __future__ import annotations

import pytest
import torch

from preempt.kernels.gather_blocks import gather_blocks, gather_blocks_batch, gather_blocks_ref
from tests.kernels.conftest import assert_bits_equal, random_cache

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def saver_gather(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """preempt/kv/saver.py's `_gather`, restated on the raw tensor: the behaviour to keep."""
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    num_blocks = -(-num_tokens // block_size)
    blocks = kv_cache.index_select(2, torch.tensor(block_ids[:num_blocks]))
    shape = (num_layers, 2, num_blocks * block_size, num_heads, head_dim)
    return blocks.reshape(shape)[:, :, :num_tokens].contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_ref_bit_exactly(interp, dtype):
    cache = random_cache(2, 10, 4, 2, 8, dtype, device=interp)
    cache[1, 1, 7, 2, 1, 3] = float("nan")  # integer copies keep NaN and -0.0 bits
    block_ids = torch.tensor([7, 2, 9, 0], device=interp)
    for num_tokens in (13, 16, 1, 0):
        out = gather_blocks(cache, block_ids, num_tokens, use_triton=True)
        assert out.shape == (2, 2, num_tokens, 2, 8) and out.is_contiguous()
        assert_bits_equal(out, gather_blocks_ref(cache, block_ids, num_tokens))


def test_batch_kernel_matches_ref_per_request(interp):
    cache = random_cache(2, 12, 4, 3, 4, torch.bfloat16, device=interp)
    table = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 0, 0, 0], [11, 10, 9, 8]], dtype=torch.int32)
    lens = [13, 5, 0, 16]
    outs = gather_blocks_batch(cache, table, lens, use_triton=True)
    refs = gather_blocks_batch(cache, table, lens, use_triton=False)
    for out, ref, row, n in zip(outs, refs, table, lens, strict=True):
        assert out.shape == (2, 2, n, 3, 4) and out.is_contiguous()
        assert_bits_equal(out, ref)
        assert_bits_equal(out, gather_blocks_ref(cache, row, n))
    assert outs[0].untyped_storage().data_ptr() == outs[3].untyped_storage().data_ptr()  # one allocation


def test_bad_arguments_are_errors(interp):
    cache = random_cache(1, 4, 4, 1, 4, torch.float16, device=interp)
    with pytest.raises(ValueError, match="need 2 blocks"):
        gather_blocks(cache, [0], 5, use_triton=True)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        gather_blocks(cache, [0, 4], 5, use_triton=True)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        gather_blocks(cache[0], [0], 1, use_triton=True)
    with pytest.raises(ValueError, match="must be contiguous"):
        gather_blocks(cache.transpose(4, 5), [0], 1, use_triton=True)
    with pytest.raises(ValueError, match="not supported"):
        gather_blocks(cache.to(torch.int8), [0], 1, use_triton=True)


def test_ref_equals_the_saver_gather_at_a_realistic_size():
    # Llama-3-8B-like per-token shape (8 KV heads x 128), 8 layers, 1000 tokens in shuffled blocks.
    cache = random_cache(8, 80, 16, 8, 128, torch.bfloat16)
    block_ids = torch.randperm(80, generator=torch.Generator().manual_seed(0)).tolist()
    out = gather_blocks(cache, block_ids, 1000)  # CPU default: the torch path
    assert_bits_equal(out, saver_gather(cache, block_ids, 1000))


@pytest.mark.gpu
def test_compiled_kernel_matches_ref_on_gpu(cuda):
    for dtype in DTYPES:
        cache = random_cache(4, 300, 16, 8, 128, dtype, device=cuda)
        block_ids = torch.randperm(300, device=cuda)
        out = gather_blocks(cache, block_ids, 4000)
        assert_bits_equal(out, gather_blocks_ref(cache, block_ids, 4000))
        table = torch.stack([block_ids, block_ids.flip(0)])
        outs = gather_blocks_batch(cache, table, [4000, 17])
        assert_bits_equal(outs[1], gather_blocks_ref(cache, block_ids.flip(0), 17))
