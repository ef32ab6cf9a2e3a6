"""The block-table update of the zero-copy context switch (docs/design.md §4).

Owns: re-pointing one request's row of the block table (logical block j -> physical
block id). Switching requests in or out of the batch only rewrites such rows; no KV data
moves. This is the torch/numpy reference of the article's `update_block_table` kernel (the
Triton version lives in `preempt/kernels/`); it decides nothing about which blocks a request
owns (the block pool and scheduler do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def update_block_table(
    block_table: np.ndarray | torch.Tensor,  # (R, M) physical block ids
    row: int,
    block_ids: Sequence[int] | np.ndarray | torch.Tensor,  # (n,), n <= M
) -> None:
    """Point `block_table[row, :n]` at `block_ids`; the rest of the row is left as is
    (it is never read: attention masks positions past the sequence's length)."""
    num_blocks = len(block_ids)
    if num_blocks > block_table.shape[1]:
        raise ValueError(f"{num_blocks} block ids do not fit a block-table row of {block_table.shape[1]}")
    if not 0 <= row < block_table.shape[0]:
        raise IndexError(f"row {row} outside a block table of {block_table.shape[0]} rows")
    if isinstance(block_table, torch.Tensor):
        block_ids = torch.as_tensor(block_ids, dtype=block_table.dtype, device=block_table.device)
    block_table[row, :num_blocks] = block_ids
