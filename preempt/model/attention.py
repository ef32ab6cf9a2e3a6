"""Paged attention over a block-structured KV cache, in plain torch (CPU fast path).

Owns: `AttentionMetadata` (the per-step index tensors, built once per step by
`build_attention_metadata` and reused by every layer), `write_kv` (new K/V -> cache slots)
and `paged_attention` (queries attend to K/V read from the cache through block tables).
It never allocates or frees cache blocks and never decides which tokens run.

Layout: one layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; a token at
absolute position p of a sequence lives in flat slot `block_table[p // bs] * bs + p % bs`.
The new tokens of a step are written into the cache *before* attention, so attention reads
all keys, old and new, from the cache alone.

Why the two paths: decode sequences (1 new token) are batched into one
`scaled_dot_product_attention` call per group over a padded [n, ctx, Hkv, D] gather; the
gather is done with `index_select` on whole blocks (2x faster than advanced indexing on
slots) and in groups of a few MiB so the gathered K/V is still in cache when SDPA reads it
(measured ~30% faster than one big group at batch 64, 1.3k context). Prefill chunks are
few per step and long, so they run one sequence at a time with a causal mask offset by
the tokens already cached. GQA goes through `enable_gqa=True`: `repeat_interleave` made
decode ~10x slower. Decode in a 16-bit dtype on CPU skips SDPA for two grouped matmuls
(`_decode_attention_16bit`): torch's CPU SDPA is ~5x slower in bfloat16 than in float32
for one query over a long context (5.9 vs 1.2 ms at 8 sequences x 1.5k keys, 8 heads over
2), and it was half the tiny model's replay time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from preempt.core.block_table import update_block_table

# Gathered K+V bytes per decode group per layer: small enough to stay in L2/L3 between
# the gather and SDPA's read of it (see module docstring).
DEFAULT_DECODE_GROUP_BYTES = 4 << 20


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended together: one gather, one SDPA call."""

    token_indices: torch.Tensor  # (n,) rows of the flattened batch
    block_ids: torch.Tensor  # (n * num_blocks,) flattened padded block tables
    num_blocks: int  # blocks per sequence after padding
    max_seq_len: int  # keys read per sequence (the longest context in the group)
    attn_mask: torch.Tensor | None  # (n, 1, 1, max_seq_len) bool, True = attend; None = all
    seq_indices: torch.Tensor | None = None  # (n,) the group's sequences (rows of masked_until)


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with more than one new token (a prompt chunk)."""

    token_start: int  # rows [token_start, token_end) of the flattened batch
    token_end: int
    seq_len: int  # context after this step, new tokens included
    block_ids: torch.Tensor  # (ceil(seq_len / bs),)
    attn_mask: torch.Tensor | None  # (n, seq_len) bool; None = plain causal (no cached prefix)
    seq_index: int = 0  # the sequence (row of masked_until)


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors of one step for a flattened batch of B sequences and T new tokens.

    Built once per step (`build_attention_metadata`) and shared by all layers.
    """

    positions: torch.Tensor  # (T,) int64 absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot of each new token
    query_start_loc: torch.Tensor  # (B+1,) int64 first row of each sequence
    seq_lens: torch.Tensor  # (B,) int64 context length after this step
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with block 0
    logits_indices: torch.Tensor  # (B,) int64 last new row of each sequence
    block_size: int
    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    # (B, num_layers, Hkv) per sequence: keys at positions below this are masked for that KV
    # head (and its query heads), where a lossy restore dropped the head's saved KV; None
    # when no sequence of the step has a dropped head (`with_masked_prefixes`).
    masked_until: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_attention_metadata(
    starts: Sequence[int],
    num_new_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    *,
    kv_bytes_per_token_per_layer: int = 512,
    decode_group_bytes: int = DEFAULT_DECODE_GROUP_BYTES,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Index tensors for sequences whose new tokens are positions [starts[i], starts[i] + n_i).

    `block_ids[i]` maps logical block j of sequence i to a physical block; it must cover
    the sequence's context after this step (extra trailing blocks are ignored).
    `kv_bytes_per_token_per_layer` (K + V of one token in one layer) sizes decode groups.
    """
    num_seqs = len(starts)
    if not (num_seqs == len(num_new_tokens) == len(block_ids)) or num_seqs == 0:
        raise ValueError("starts, num_new_tokens and block_ids must be non-empty and of equal length")
    starts_np = np.asarray(starts, dtype=np.int64)  # (B,)
    num_new_np = np.asarray(num_new_tokens, dtype=np.int64)  # (B,)
    if (starts_np < 0).any() or (num_new_np <= 0).any():
        raise ValueError("starts must be >= 0 and num_new_tokens > 0")
    seq_lens_np = starts_np + num_new_np
    num_blocks_np = (seq_lens_np + block_size - 1) // block_size  # (B,) blocks each context needs
    block_tables_np = np.zeros((num_seqs, int(num_blocks_np.max())), dtype=np.int64)
    for i, (ids, nb) in enumerate(zip(block_ids, num_blocks_np.tolist(), strict=True)):
        if len(ids) < nb:
            raise ValueError(
                f"sequence {i}: {len(ids)} blocks cannot hold {int(seq_lens_np[i])} tokens "
                f"at block_size {block_size}"
            )
        update_block_table(block_tables_np, i, ids[:nb])

    query_start_np = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new_np, out=query_start_np[1:])
    num_tokens = int(query_start_np[-1])
    # Vectorised per-token indices: never a Python loop over tokens.
    seq_of_token = np.repeat(np.arange(num_seqs), num_new_np)  # (T,)
    positions_np = np.arange(num_tokens) - query_start_np[seq_of_token] + starts_np[seq_of_token]  # (T,)
    block_of_token = block_tables_np[seq_of_token, positions_np // block_size]  # (T,)
    slot_np = block_of_token * block_size + positions_np % block_size  # (T,)

    def to_tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    block_tables = to_tensor(block_tables_np)
    decode_groups = _build_decode_groups(
        seq_lens_np,
        num_new_np,
        query_start_np,
        block_tables_np,
        num_blocks_np,
        block_size,
        max(1, decode_group_bytes // max(1, kv_bytes_per_token_per_layer)),
        to_tensor,
    )
    prefill_chunks = []
    for i in np.flatnonzero(num_new_np > 1).tolist():
        start, n, seq_len = int(starts_np[i]), int(num_new_np[i]), int(seq_lens_np[i])
        mask = None
        if start > 0:
            # Query at position start + r sees keys 0..start + r (the cached prefix and itself).
            mask = torch.arange(seq_len, device=device)[None, :] <= (
                start + torch.arange(n, device=device)[:, None]
            )  # (n, seq_len)
        prefill_chunks.append(
            PrefillChunk(
                token_start=int(query_start_np[i]),
                token_end=int(query_start_np[i + 1]),
                seq_len=seq_len,
                block_ids=block_tables[i, : int(num_blocks_np[i])],
                attn_mask=mask,
                seq_index=i,
            )
        )
    return AttentionMetadata(
        positions=to_tensor(positions_np),
        slot_mapping=to_tensor(slot_np),
        query_start_loc=to_tensor(query_start_np),
        seq_lens=to_tensor(seq_lens_np),
        block_tables=block_tables,
        logits_indices=to_tensor(query_start_np[1:] - 1),
        block_size=block_size,
        decode_groups=tuple(decode_groups),
        prefill_chunks=tuple(prefill_chunks),
    )


def _build_decode_groups(
    seq_lens: np.ndarray,  # (B,)
    num_new: np.ndarray,  # (B,)
    query_start: np.ndarray,  # (B+1,)
    block_tables: np.ndarray,  # (B, max_blocks)
    num_blocks: np.ndarray,  # (B,)
    block_size: int,
    max_group_tokens: int,
    to_tensor: Callable[[np.ndarray], torch.Tensor],
) -> list[DecodeGroup]:
    decode_seqs = np.flatnonzero(num_new == 1)
    # Sorting by length keeps each group's padding small.
    decode_seqs = decode_seqs[np.argsort(seq_lens[decode_seqs], kind="stable")]
    groups = []
    begin = 0
    while begin < decode_seqs.size:
        end = begin + 1
        # Ascending order: a group's padded size is its count times its last member's blocks.
        while (
            end < decode_seqs.size
            and (end - begin + 1) * int(num_blocks[decode_seqs[end]]) * block_size <= max_group_tokens
        ):
            end += 1
        seqs = decode_seqs[begin:end]
        group_lens = seq_lens[seqs]
        max_len = int(group_lens[-1])
        mask = None
        if int(group_lens[0]) != max_len:
            mask_np = np.arange(max_len)[None, :] < group_lens[:, None]  # (n, max_len)
            mask = to_tensor(mask_np[:, None, None, :])
        group_blocks = int(num_blocks[seqs[-1]])
        groups.append(
            DecodeGroup(
                token_indices=to_tensor(query_start[seqs]),
                block_ids=to_tensor(block_tables[seqs, :group_blocks].reshape(-1)),
                num_blocks=group_blocks,
                max_seq_len=max_len,
                attn_mask=mask,
                seq_indices=to_tensor(seqs),
            )
        )
        begin = end
    return groups


def with_masked_prefixes(
    meta: AttentionMetadata, masked_until: Sequence[np.ndarray | None], num_layers: int, num_kv_heads: int
) -> AttentionMetadata:
    """`meta` with each sequence's masked prefixes ((L, Hkv) int positions, or None for
    none); unchanged when no sequence has one (the common case costs nothing)."""
    if all(m is None for m in masked_until):
        return meta
    table = np.zeros((len(masked_until), num_layers, num_kv_heads), dtype=np.int64)
    for i, m in enumerate(masked_until):
        if m is not None:
            table[i] = m
    return dataclasses.replace(meta, masked_until=torch.from_numpy(table).to(meta.seq_lens.device))


def _prefix_visible(masked_until: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, group: int):
    """(..., Hkv) masked positions, (K,) key and (..., Q) query positions -> (..., Hq, Q, K)
    bool, True = attend: keys below a head's masked position are hidden from queries at or
    past it. (A query before it never runs after a restore; it sees all keys rather than
    none, so a softmax can never be empty.)"""
    mu = masked_until.repeat_interleave(group, dim=-1)[..., :, None, None]  # (..., Hq, 1, 1)
    return (key_pos >= mu) | (query_pos[..., None, :, None] < mu)


def write_kv(
    k_cache: torch.Tensor,  # (num_blocks, bs, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, bs, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
) -> None:
    """Store the new tokens' K/V at their flat slots (in place)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _decode_attention_16bit(
    q: torch.Tensor,  # (n, Hq, 1, D)
    k: torch.Tensor,  # (n, Hkv, L, D), any strides
    v: torch.Tensor,  # (n, Hkv, L, D)
    attn_mask: torch.Tensor | None,  # (n, 1 or Hq, 1, L) bool, True = attend
    scale: float,
) -> torch.Tensor:
    """One query per sequence, as SDPA with `enable_gqa=True` computes it: query head h
    reads KV head h // group, so the group's queries stack into one matmul. Scores and
    softmax in float32; the two matmuls accumulate in float32 and round to q's dtype, as
    a 16-bit flash kernel's do (error within one 16-bit ulp of a float64 reference)."""
    n, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # K made contiguous first: against the strided gather view the batched matmul is ~5x
    # slower than the copy and a contiguous matmul together
    scores = torch.matmul(q.view(n, num_kv_heads, group, head_dim), k.contiguous().transpose(-1, -2)).float()
    scores.mul_(scale)  # (n, Hkv, group, L)
    if attn_mask is not None:
        # (n, 1, 1, L) masks every head alike; (n, Hq, 1, L) per head, grouped as the queries
        heads = attn_mask.view(n, num_kv_heads, group, -1) if attn_mask.shape[1] > 1 else attn_mask
        scores.masked_fill_(~heads, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(n, num_heads, 1, head_dim)


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, bs, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, bs, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys -> (T, Hq, D).

    Reads K/V only from the cache, through the block tables: `write_kv` must have stored
    this step's tokens first. A query at absolute position p sees keys at positions <= p,
    except the masked prefixes of heads a lossy restore dropped (`meta.masked_until`,
    row `layer`).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    masked = None if meta.masked_until is None else meta.masked_until[:, layer]  # (B, Hkv)
    out = q.new_empty(num_tokens, num_heads, head_dim)  # (T, Hq, D); every row written below
    for group in meta.decode_groups:
        n = group.token_indices.shape[0]
        ctx = group.num_blocks * block_size
        # (n, ctx, Hkv, D) -> (n, Hkv, L, D) as a strided view: SDPA reads it without a copy.
        k = k_cache.index_select(0, group.block_ids).view(n, ctx, num_kv_heads, head_dim)
        v = v_cache.index_select(0, group.block_ids).view(n, ctx, num_kv_heads, head_dim)
        k = k[:, : group.max_seq_len].transpose(1, 2)
        v = v[:, : group.max_seq_len].transpose(1, 2)
        q_dec = q.index_select(0, group.token_indices).unsqueeze(2)  # (n, Hq, 1, D)
        attn_mask = group.attn_mask
        if masked is not None and bool(masked[group.seq_indices].any()):
            key_pos = torch.arange(group.max_seq_len, device=q.device)
            query_pos = meta.seq_lens[group.seq_indices][:, None] - 1  # (n, 1)
            visible = _prefix_visible(masked[group.seq_indices], key_pos, query_pos, group_size)
            attn_mask = visible if attn_mask is None else visible & attn_mask  # (n, Hq, 1, L)
        if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
            o = _decode_attention_16bit(q_dec, k, v, attn_mask, scale)
        else:
            o = F.scaled_dot_product_attention(
                q_dec, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True
            )  # (n, Hq, 1, D)
        out.index_copy_(0, group.token_indices, o.squeeze(2))
    for chunk in meta.prefill_chunks:
        num_blocks = chunk.block_ids.shape[0]
        k = k_cache.index_select(0, chunk.block_ids).view(num_blocks * block_size, num_kv_heads, head_dim)
        v = v_cache.index_select(0, chunk.block_ids).view(num_blocks * block_size, num_kv_heads, head_dim)
        k = k[: chunk.seq_len].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
        v = v[: chunk.seq_len].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
        q_pre = q[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        attn_mask = chunk.attn_mask
        if masked is not None and bool(masked[chunk.seq_index].any()):
            n = chunk.token_end - chunk.token_start
            key_pos = torch.arange(chunk.seq_len, device=q.device)
            query_pos = key_pos[chunk.seq_len - n :]  # (n,)
            causal = key_pos[None, :] <= query_pos[:, None]  # (n, S)
            attn_mask = (_prefix_visible(masked[chunk.seq_index], key_pos, query_pos, group_size) & causal)[
                None
            ]
        o = F.scaled_dot_product_attention(
            q_pre,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            scale=scale,
            enable_gqa=True,
        )  # (1, Hq, n, D)
        out[chunk.token_start : chunk.token_end] = o[0].transpose(0, 1)
    return out
