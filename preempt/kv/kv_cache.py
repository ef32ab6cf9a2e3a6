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
