"""The article's `update_block_table` kernel (docs/design.md §4, zero-copy context switch), on the device.

Owns: `_update_block_table_kernel` and its wrappers: `update_block_table` (one request's
row, the article's kernel; same contract as preempt/core/block_table.py) and
`update_block_table_rows` (several rows in one launch, for a step that switches many
requests). `update_block_table_ref` is preempt/core/block_table.py's reference itself. It
moves no KV data and decides nothing about which blocks a request owns.

Contract (from the reference): `block_table[row, :n] = block_ids`; the rest of the row is
left as is (attention masks positions past the sequence's length, so it is never read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from preempt.core.block_table import update_block_table as update_block_table_ref
from preempt.kernels import dispatch

__all__ = ["update_block_table", "update_block_table_ref", "update_block_table_rows"]

_BLOCK = 1024


@triton.jit
def _update_block_table_kernel(
    table_ptr,  # (R, M) physical block ids, written in place
    rows_ptr,  # (k,) rows to re-point
    ids_ptr,  # (k, N) new block ids, row i valid up to lens[i]
    lens_ptr,  # (k,) number of ids per row
    stride_table,
    stride_ids,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < tl.load(lens_ptr + i)
    row = tl.load(rows_ptr + i).to(tl.int64)
    ids = tl.load(ids_ptr + i * stride_ids + j, mask=mask)
    tl.store(table_ptr + row * stride_table + j, ids.to(table_ptr.dtype.element_ty), mask=mask)


def update_block_table(
    block_table: torch.Tensor,  # (R, M) physical block ids
    row: int,
    block_ids: torch.Tensor | Sequence[int],  # (n,), n <= M
    *,
    use_triton: bool | None = None,
) -> None:
    """Point `block_table[row, :n]` at `block_ids` (in place)."""
    if not dispatch.use_triton(block_table.device, use_triton):
        update_block_table_ref(block_table, row, block_ids)
        return
    # like the reference: ids take the table's dtype (an empty list would be float otherwise)
    block_ids = torch.as_tensor(block_ids, dtype=block_table.dtype, device=block_table.device)
    if block_ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    update_block_table_rows(block_table, [row], block_ids[None], [block_ids.numel()], use_triton=True)


def update_block_table_rows(
    block_table: torch.Tensor,  # (R, M) physical block ids
    rows: Sequence[int],  # (k,) distinct rows
    block_ids: torch.Tensor,  # (k, N) new ids, padded
    lens: Sequence[int],  # (k,) ids per row, each <= min(N, M)
    *,
    use_triton: bool | None = None,
) -> None:
    """Re-point several rows in one launch: `block_table[rows[i], :lens[i]] = block_ids[i, :lens[i]]`."""
    if block_table.ndim != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be 2-D int32/int64, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be int32 or int64, got {block_ids.dtype}")
    rows, lens = [int(r) for r in rows], [int(n) for n in lens]
    if block_ids.ndim != 2 or block_ids.shape[0] != len(rows) or len(lens) != len(rows):
        raise ValueError(
            f"{len(rows)} rows need block_ids (k, N) and k lens, got {tuple(block_ids.shape)}, {len(lens)}"
        )
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows must be distinct, got {rows}")  # two writers of one row would race
    for row, n in zip(rows, lens, strict=True):
        if not 0 <= row < block_table.shape[0]:
            raise IndexError(f"row {row} outside a block table of {block_table.shape[0]} rows")
        if not 0 <= n <= block_ids.shape[1]:
            raise ValueError(f"row {row}: {n} ids, block_ids has {block_ids.shape[1]} columns")
        if n > block_table.shape[1]:
            raise ValueError(f"{n} block ids do not fit a block-table row of {block_table.shape[1]}")
    if not dispatch.use_triton(block_table.device, use_triton):
        for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
            update_block_table_ref(block_table, row, block_ids[i, :n])
        return
    if not rows or max(lens) == 0:
        return
    if block_ids.device != block_table.device or block_ids.stride(1) != 1:
        block_ids = block_ids.to(block_table.device).contiguous()
    device = block_table.device
    grid = (len(rows), triton.cdiv(max(lens), _BLOCK))
    dispatch.launchable(_update_block_table_kernel, device)[grid](
        block_table,
        torch.tensor(rows, dtype=torch.int64, device=device),
        block_ids,
        torch.tensor(lens, dtype=torch.int64, device=device),
        block_table.stride(0),
        block_ids.stride(0),
        BLOCK=min(_BLOCK, triton.next_power_of_2(max(lens))),
    )
