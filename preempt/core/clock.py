"""The engine's notion of time.

Owns: `now()` and how time passes. `VirtualClock` moves only when told (by the cost
model's step durations), so the same config and seed give identical timestamps on any
machine. `WallClock` is real time, for the server and for measuring real overlap.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    @abstractmethod
    def now(self) -> float:
        """Seconds since the clock started."""

    @abstractmethod
    def advance(self, seconds: float) -> None:
        """A step that took `seconds` (modelled) has run."""

    @abstractmethod
    def wait_until(self, t: float) -> None:
        """Idle until time `t` (no work to do before then)."""


class VirtualClock(Clock):
    def __init__(self) -> None:
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        self._now += seconds

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)


class WallClock(Clock):
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def advance(self, seconds: float) -> None:
        pass  # real time already passed while the step ran

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


def make_clock(kind: str) -> Clock:
    if kind == "virtual":
        return VirtualClock()
    if kind == "wall":
        return WallClock()
    raise ValueError(f"unknown clock.kind '{kind}'")
