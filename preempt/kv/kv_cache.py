"""The device KV pool: preallocated K and V tensors of every layer, addressed by block id.

Owns: the tensors (allocated once, zero-filled, freed by `close`), their layout and sizes,
and block-level copies in and out (for the saver/restorer). It decides nothing: which
block belongs to whom is the block pool's business, what to compute is the scheduler's.

Layout: one tensor `kv` of shape (num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim); `k_caches[l]` / `v_caches[l]` are contiguous views `[num_blocks, block_size,
num_kv_heads, head_dim]`. Zero-filled rather than `empty` because attention gathers whole
padded blocks: a masked key still multiplies its value by 0, and 0 * NaN from
uninitialised memory would be NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from preempt.kv.codec import CorruptBlobError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KVCache dimensions must all be > 0")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.k_caches: list[torch.Tensor] = [self.kv[layer, 0] for layer in range(num_layers)]
        self.v_caches: list[torch.Tensor] = [self.kv[layer, 1] for layer in range(num_layers)]
        self.closed = False

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), the form the model's forward takes."""
        return list(zip(self.k_caches, self.v_caches, strict=True))

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def close(self) -> None:
        """Free the tensors (the engine's `close`). Idempotent; block copies raise after it."""
        self.kv = torch.empty(0, dtype=self.dtype, device=self.kv.device)
        self.k_caches = []
        self.v_caches = []
        self.closed = True

    def _index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if self.closed:
            raise RuntimeError("the KV cache is closed (Engine.close() freed it)")
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.kv.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.num_blocks})")
        return index

    def read_blocks(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Copy of the given blocks: (num_layers, 2, n, block_size, num_kv_heads, head_dim)."""
        return self.kv.index_select(2, self._index(block_ids))

    def write_blocks(self, block_ids: Sequence[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Inverse of `read_blocks`: store `data` (same shape) into the given blocks."""
        index = self._index(block_ids)
        expected = (self.num_layers, 2, index.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks expects shape {expected}, got {tuple(data.shape)}")
        self.kv.index_copy_(2, index, data.to(self.dtype))

    # ---- a request's KV by block table and token range: what a codec's device side reads
    # and writes (preempt.kv.codec.PagedCache). Whole blocks: the last block's unused slots
    # ride along (copying block-sized runs is faster than token-sized ones).

    def _blocks_of(self, block_ids: Sequence[int], start: int, num_tokens: int) -> list[int]:
        first = start // self.block_size
        return list(block_ids[first : first + -(-num_tokens // self.block_size)])

    def raw_nbytes(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.bytes_per_block

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """The tokens' blocks: (num_layers, 2, n, block_size, num_kv_heads, head_dim), a copy."""
        return self.read_blocks(self._blocks_of(block_ids, start, num_tokens))

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        blocks = self._blocks_of(block_ids, start, num_tokens)
        expected = (self.num_layers, 2, len(blocks), self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise CorruptBlobError(  # a valid blob, but not this request's KV
                f"saved KV {tuple(kv.shape)} of {kv.dtype} does not fit {expected} of {self.dtype}"
            )
        self.write_blocks(blocks, kv)

    def gather_quantized(self, block_ids: Sequence[int], start: int, num_tokens: int, plan):
        """Gather and quantize in one pass over exactly the tokens (Triton on CUDA)."""
        from preempt.kernels.quantize_heads import gather_quantize_heads

        return gather_quantize_heads(self.kv, self._blocks_of(block_ids, start, num_tokens), num_tokens, plan)

    def scatter_quantized(self, quantized, block_ids: Sequence[int], start: int, num_tokens: int):
        """Dequantize into the blocks; the dropped heads (L, H) bool, for attention to mask."""
        from preempt.kernels.restore_blocks import restore_blocks

        if (
            quantized.num_tokens != num_tokens
            or quantized.dtype != self.dtype
            or quantized.head_dim != self.head_dim
            or (quantized.plan.num_layers, quantized.plan.num_kv_heads)
            != (self.num_layers, self.num_kv_heads)
        ):
            raise CorruptBlobError("saved KV does not fit this cache")  # a valid blob, not this request's
        blocks = self._blocks_of(block_ids, start, num_tokens)
        return restore_blocks(quantized.to(self.kv.device), self.kv, blocks).cpu().numpy()
