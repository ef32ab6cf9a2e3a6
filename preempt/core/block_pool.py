"""The pool of physical KV blocks: who owns which block, and which are free.

Owns: the free list and exact accounting (free + used == total, always). Plain Python,
no torch: it decides, the KV cache tensors act. It never looks at requests or tokens;
callers ask in blocks (`blocks_needed` converts tokens to blocks).
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """Misuse of the pool (double free, over-allocation): a bug, never a load condition."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse spreads writes over the pool, which keeps bugs that read a stale
        # block visible in tests instead of hiding them behind the most recently freed one.
        self._free: deque[int] = deque(range(num_blocks))
        self._is_used = [False] * num_blocks

    def __deepcopy__(self, memo: dict[int, object]) -> BlockPool:
        # Flat lists of ints: copied shallowly (deepcopy's walk over them made a fork 10x slower).
        copied = object.__new__(BlockPool)
        copied.num_blocks = self.num_blocks
        copied._free = deque(self._free)
        copied._is_used = list(self._is_used)
        return copied

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise BlockPoolError(f"asked for {num} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(num)]
        for block_id in out:
            self._is_used[block_id] = True
        return out

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not self._is_used[block_id]:
                raise BlockPoolError(f"block {block_id} freed but not in use")
            self._is_used[block_id] = False
            self._free.append(block_id)

    def check(self) -> None:
        """Assert the accounting invariant (tests and debug runs call this)."""
        num_used = sum(self._is_used)
        if num_used + len(self._free) != self.num_blocks or len(set(self._free)) != len(self._free):
            raise BlockPoolError(
                f"accounting drift: used={num_used} free={len(self._free)} total={self.num_blocks}"
            )
