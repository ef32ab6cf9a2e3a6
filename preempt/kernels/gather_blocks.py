"""Gather a request's paged KV blocks into logical token order (save path, docs/design.md §2 step 2).

Owns: the `_gather_blocks_kernel` Triton kernel, its wrappers `gather_blocks` (one
request: block ids + token count) and `gather_blocks_batch` (many requests: a padded
block table + lengths, one launch), and their torch references. It only reads the cache;
which blocks belong to whom is the block pool's business.

Layout: cache (L, 2, num_blocks, block_size, H, D) -> one request's KV (L, 2, T, H, D),
contiguous, token t read from block `block_ids[t // block_size]`, row `t % block_size`.
The batch form returns one contiguous (L, 2, T_r, H, D) tensor per request, all views of
one flat allocation, so each can be handed to a codec or a host copy on its own.

Kernel: one program per (token tile, request, layer*2+kv) copies BLOCK_T token rows of
H*D elements, as integers (bit-exact for any dtype). Tokens are not split across
programs by head, because one token's (H, D) row is contiguous in both cache and output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from preempt.kernels import dispatch

_TILE_ELEMS = 4096  # elements per program tile: big enough to amortise index math, small for registers


@triton.jit
def _gather_blocks_kernel(
    src_ptr,  # integer view of the cache (L, 2, num_blocks, block_size, H*D)
    out_ptr,  # flat integer output; request r at out_offsets[r], laid out (L, 2, T_r, H*D)
    table_ptr,  # (R, M) physical block ids
    lens_ptr,  # (R,) tokens per request
    out_offsets_ptr,  # (R,) int64 element offset of each request's output
    stride_l,
    stride_kv,
    stride_blk,
    stride_tok,
    stride_table,
    block_size,
    row_elems,  # H * D
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    lkv = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(lens_ptr + req).to(tl.int64)
    t = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) token positions
    t_mask = t < seq_len
    blk = tl.load(table_ptr + req * stride_table + t // block_size, mask=t_mask, other=0).to(tl.int64)
    src_rows = (
        (lkv // 2) * stride_l + (lkv % 2) * stride_kv + blk * stride_blk + (t % block_size) * stride_tok
    )
    j = tl.arange(0, BLOCK_HD)
    mask = t_mask[:, None] & (j < row_elems)[None, :]
    x = tl.load(src_ptr + src_rows[:, None] + j[None, :], mask=mask)
    out_base = tl.load(out_offsets_ptr + req) + lkv * seq_len * row_elems
    tl.store(out_ptr + out_base + t[:, None] * row_elems + j[None, :], x, mask=mask)


def gather_blocks(
    kv_cache: torch.Tensor,  # (L, 2, num_blocks, block_size, H, D)
    block_ids: torch.Tensor | Sequence[int],  # (n,) with n >= ceil(num_tokens / block_size)
    num_tokens: int,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # (L, 2, T, H, D)
    """One request's KV in logical order, a new contiguous tensor on the cache's device."""
    block_ids = torch.as_tensor(block_ids, device=kv_cache.device)
    if block_ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if not dispatch.use_triton(kv_cache.device, use_triton):
        return gather_blocks_ref(kv_cache, block_ids, num_tokens)
    return gather_blocks_batch(kv_cache, block_ids[None], [num_tokens], use_triton=True)[0]


def gather_blocks_batch(
    kv_cache: torch.Tensor,  # (L, 2, num_blocks, block_size, H, D)
    block_table: torch.Tensor,  # (R, M) physical block ids, padded rows
    seq_lens: torch.Tensor | Sequence[int],  # (R,) tokens per request
    *,
    use_triton: bool | None = None,
) -> list[torch.Tensor]:  # R x (L, 2, T_r, H, D)
    """Many requests' KV in one launch: one contiguous (L, 2, T_r, H, D) per request, all
    views of one flat buffer (its storage is freed when every view is)."""
    dispatch.check_kv_cache(kv_cache)
    num_layers, _, num_blocks, block_size, num_heads, head_dim = kv_cache.shape
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be (num_requests, max_blocks), got {tuple(block_table.shape)}")
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if len(lens) != block_table.shape[0]:
        raise ValueError(f"{len(lens)} seq_lens for a block table of {block_table.shape[0]} rows")
    for r, n in enumerate(lens):
        if n < 0 or triton.cdiv(n, block_size) > block_table.shape[1]:
            raise ValueError(
                f"request {r}: {n} tokens need {triton.cdiv(max(n, 0), block_size)} blocks, "
                f"the block table has {block_table.shape[1]} columns"
            )
    dispatch.check_block_ids(block_table, kv_cache.device, num_blocks, "block_table")
    row_elems = num_heads * head_dim
    sizes = [num_layers * 2 * n * row_elems for n in lens]
    flat = torch.empty(sum(sizes), dtype=kv_cache.dtype, device=kv_cache.device)
    offsets, views, start = [], [], 0
    for n, size in zip(lens, sizes, strict=True):
        offsets.append(start)
        views.append(flat[start : start + size].view(num_layers, 2, n, num_heads, head_dim))
        start += size
    if not dispatch.use_triton(kv_cache.device, use_triton):
        for r, (n, view) in enumerate(zip(lens, views, strict=True)):
            view.copy_(gather_blocks_ref(kv_cache, block_table[r], n))
        return views
    if max(lens, default=0) == 0:
        return views
    src, _ = dispatch.storage_view(kv_cache)
    out, _ = dispatch.storage_view(flat)
    block_hd = triton.next_power_of_2(row_elems)
    block_t = max(1, min(triton.next_power_of_2(max(lens)), _TILE_ELEMS // block_hd))
    grid = (triton.cdiv(max(lens), block_t), len(lens), num_layers * 2)
    device = kv_cache.device
    dispatch.launchable(_gather_blocks_kernel, device)[grid](
        src,
        out,
        block_table,
        torch.tensor(lens, dtype=torch.int64, device=device),
        torch.tensor(offsets, dtype=torch.int64, device=device),
        src.stride(0),
        src.stride(1),
        src.stride(2),
        src.stride(3),
        block_table.stride(0),
        block_size,
        row_elems,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )
    return views


def gather_blocks_ref(
    kv_cache: torch.Tensor,  # (L, 2, num_blocks, block_size, H, D)
    block_ids: torch.Tensor | Sequence[int],  # (n,)
    num_tokens: int,
) -> torch.Tensor:  # (L, 2, T, H, D)
    """Torch reference (and the CPU path): one `index_select` of exactly the T token rows
    (flat slot = block * block_size + offset), so the partial last block costs no second
    copy."""
    dispatch.check_kv_cache(kv_cache)
    num_layers, _, num_blocks, block_size, num_heads, head_dim = kv_cache.shape
    block_ids = torch.as_tensor(block_ids, device=kv_cache.device)
    if triton.cdiv(num_tokens, block_size) > block_ids.numel():
        raise ValueError(f"{num_tokens} tokens need more than the {block_ids.numel()} block ids given")
    t = torch.arange(num_tokens, device=kv_cache.device)
    slots = block_ids.to(torch.int64)[t // block_size] * block_size + t % block_size  # (T,)
    if kv_cache.stride(2) != block_size * kv_cache.stride(3):  # blocks and rows do not merge
        blocks = kv_cache.index_select(2, block_ids.to(torch.int64)[: triton.cdiv(num_tokens, block_size)])
        shape = (num_layers, 2, blocks.shape[2] * block_size, num_heads, head_dim)
        return blocks.reshape(shape)[:, :, :num_tokens].contiguous()
    flat = kv_cache.view(num_layers, 2, num_blocks * block_size, num_heads, head_dim)
    return flat.index_select(2, slots)
