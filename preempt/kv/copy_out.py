"""Blocks still being copied out: the one model of it.

A save frees its victim's device blocks at once (the scheduler hands them to others in
the same step), but on the virtual clock their device-to-host copy runs until the save's
`copy_end_s`. A step that allocates into blocks freed by this step's saves therefore
waits until the latest save's copy-out ends (`wait_until_s`); one that fits in blocks
that were free anyway does not. The scheduler feeds it (each save's copy end, each
freed and allocated block count) and reports the wait in its output; the engine stalls
compute by it. Plain Python.
"""

from __future__ import annotations


class CopyOut:
    def __init__(self) -> None:
        self.end_s = 0.0  # when the latest save's copy-out ends (virtual clock; 0 on the wall)
        self._num_freed = 0  # blocks freed this step by saves, still being copied out
        self._is_reused = False  # this step allocated into them

    def new_step(self) -> None:
        self._num_freed = 0
        self._is_reused = False

    def saved(self, copy_end_s: float) -> None:
        """A save's copies (its claimed early ones, and the tail) end at `copy_end_s`."""
        self.end_s = max(self.end_s, copy_end_s)

    def freed(self, num_blocks: int) -> None:
        """A saved victim's blocks went back to the pool."""
        self._num_freed += num_blocks

    def allocating(self, num_free_after: int) -> None:
        """An allocation leaves `num_free_after` blocks free: below the ones freed by
        saves, it reuses blocks whose copy-out may still run."""
        if num_free_after < self._num_freed:
            self._is_reused = True

    @property
    def is_reused(self) -> bool:
        return self._is_reused

    @property
    def wait_until_s(self) -> float:
        """Compute may use this step's blocks from then on (0: no wait)."""
        return self.end_s if self._is_reused else 0.0
