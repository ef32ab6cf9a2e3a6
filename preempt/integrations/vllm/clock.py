"""The plugin's time: when a step starts and how long it ran.

vLLM stamps requests with wall time; preempt's rules (ages, time slices, the rate cap's
window) need one clock for arrivals, steps and charges, so the plugin keeps its own and
stamps arrivals with it. `StepClock` makes a run reproducible; `ReplayClock` replays
another engine's step times, so both see the same `now` at every step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class WallClock:
    def __init__(self) -> None:
        self._started = time.monotonic()

    def now(self) -> float:
        return time.monotonic()

    def start_step(self, step: int) -> float:
        self._started = time.monotonic()
        return self._started

    def step_duration(self, step: int) -> float:
        return time.monotonic() - self._started


class StepClock:
    """Step k starts at k * step_s and lasts step_s. `now()` between steps is the start
    of the next one: a request added then arrives at the step that first sees it."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._next_step = 0

    def now(self) -> float:
        return self._next_step * self.step_s

    def start_step(self, step: int) -> float:
        self._next_step = step + 1
        return step * self.step_s

    def step_duration(self, step: int) -> float:
        return self.step_s


class ReplayClock:
    """Step k starts at `starts_s[k]` and is charged `durations_s[k]` (past the end: the
    last step's duration again, so a longer run still moves forward)."""

    def __init__(self, starts_s: Sequence[float], durations_s: Sequence[float]) -> None:
        if not starts_s or len(starts_s) != len(durations_s):
            raise ValueError("ReplayClock needs as many step durations as step starts (at least one)")
        self.starts_s = list(starts_s)
        self.durations_s = list(durations_s)
        self._next_step = 0

    def _start(self, step: int) -> float:
        last = len(self.starts_s) - 1
        if step <= last:
            return self.starts_s[step]
        return self.starts_s[last] + (step - last) * self.durations_s[last]

    def now(self) -> float:
        return self._start(self._next_step)  # as StepClock: the next step's start

    def start_step(self, step: int) -> float:
        self._next_step = step + 1
        return self._start(step)

    def step_duration(self, step: int) -> float:
        return self.durations_s[min(step, len(self.durations_s) - 1)]


def make_clock(kind: str, step_ms: float) -> WallClock | StepClock:
    return StepClock(step_ms / 1000.0) if kind == "steps" else WallClock()
