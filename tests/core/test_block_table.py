import numpy as np
import pytest
import torch

from preempt.core.block_table import update_block_table


@pytest.mark.parametrize(
    "make", [lambda: np.zeros((3, 5), dtype=np.int64), lambda: torch.zeros(3, 5, dtype=torch.int64)]
)
def test_update_points_one_row_and_leaves_the_rest(make):
    table = make()
    update_block_table(table, 1, [7, 2, 9])
    update_block_table(table, 2, [4])
    assert table.tolist() == [[0, 0, 0, 0, 0], [7, 2, 9, 0, 0], [4, 0, 0, 0, 0]]
    update_block_table(table, 1, [8, 8])  # re-point: the stale tail is never read
    assert table[1].tolist()[:2] == [8, 8]


def test_bad_rows_and_widths_are_errors():
    table = np.zeros((2, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        update_block_table(table, 0, [1, 2, 3])
    with pytest.raises(IndexError, match="row 2"):
        update_block_table(table, 2, [1])
