"""update_block_table: the Triton kernel == preempt/core/block_table.py's reference."""

from __future__ import annotations

import pytest
import torch

from preempt.kernels.block_table import update_block_table, update_block_table_ref, update_block_table_rows


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_matches_ref(interp, dtype):
    table, ref = torch.zeros(3, 5, dtype=dtype), torch.zeros(3, 5, dtype=dtype)
    for row, ids in ((1, [7, 2, 9]), (2, [4]), (1, [8, 8]), (0, [1, 2, 3, 4, 5]), (2, [])):
        update_block_table(table, row, ids, use_triton=True)
        update_block_table_ref(ref, row, ids)
        assert torch.equal(table, ref)
    assert table.tolist() == [[1, 2, 3, 4, 5], [8, 8, 9, 0, 0], [4, 0, 0, 0, 0]]


def test_many_rows_in_one_launch(interp):
    table, ref = torch.full((4, 6), -1, dtype=torch.int32), torch.full((4, 6), -1, dtype=torch.int32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    update_block_table_rows(table, [3, 0, 1], ids, [6, 3, 0], use_triton=True)
    update_block_table_rows(ref, [3, 0, 1], ids, [6, 3, 0], use_triton=False)
    assert torch.equal(table, ref)
    assert table[3].tolist() == [3, 1, 4, 1, 5, 9] and table[0].tolist() == [2, 6, 5, -1, -1, -1]


def test_long_rows_span_several_programs(interp):
    table = torch.zeros(2, 3000, dtype=torch.int64)
    ids = torch.randperm(2500)
    update_block_table(table, 1, ids, use_triton=True)
    assert torch.equal(table[1, :2500], ids) and not table[1, 2500:].any() and not table[0].any()


def test_errors_match_the_reference(interp):
    table = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit"):
        update_block_table(table, 0, [1, 2, 3], use_triton=True)
    with pytest.raises(IndexError, match="row 2"):
        update_block_table(table, 2, [1], use_triton=True)
    with pytest.raises(ValueError, match="distinct"):
        update_block_table_rows(table, [0, 0], torch.zeros(2, 1, dtype=torch.int64), [1, 1], use_triton=True)


@pytest.mark.gpu
def test_compiled_kernel_matches_ref_on_gpu(cuda):
    table = torch.zeros(64, 512, dtype=torch.int32, device=cuda)
    ref = table.clone()
    for row in range(0, 64, 3):
        ids = torch.randint(0, 10_000, (row * 7 + 1,), device=cuda)
        update_block_table(table, row, ids)
        update_block_table_ref(ref, row, ids)
    torch.testing.assert_close(table, ref, rtol=0, atol=0)
