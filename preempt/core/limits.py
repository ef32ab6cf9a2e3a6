"""The two clocks-and-counters of the design's preemption limits: the rate cap's sliding
window and the admission backoff after a preemption failure.

Owns: their arithmetic over times given by the caller (seconds on whatever clock the
caller runs). Plain Python, no request objects: `preempt.engine.scheduler.Scheduler` and the vLLM
plugin (`preempt.integrations.vllm`) both keep one of each, so the rules are written once.
"""

from __future__ import annotations

from collections import deque

from preempt.core.config import BackoffConfig

RATE_WINDOW_S = 60.0


class RateWindow:
    """Times of preemptions in the last `window_s` seconds (the cap counts every
    preemption, forced ones included; only priority preemptions are ever refused)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)

    def count(self, now: float) -> int:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def allows(self, now: float, limit: int | None) -> bool:
        """Whether one more priority preemption fits under `limit` (None: no cap)."""
        return limit is None or self.count(now) < limit


class AdmissionBackoff:
    """After the k-th failure in a row, new admissions wait `base_s * 2^(k-1)` (capped at
    `cap_s`); k restarts after `reset_after_s` without a failure."""

    def __init__(self, config: BackoffConfig) -> None:
        self.config = config
        self.until_s = 0.0
        self._failures_in_row = 0
        self._last_failure_s = float("-inf")

    def on_failure(self, now: float) -> float:
        """Note a failure at `now`; returns the delay it imposes."""
        if now - self._last_failure_s > self.config.reset_after_s:
            self._failures_in_row = 0
        self._failures_in_row += 1
        self._last_failure_s = now
        delay = min(self.config.cap_s, self.config.base_s * 2 ** (self._failures_in_row - 1))
        self.until_s = max(self.until_s, now + delay)
        return delay

    def holds(self, now: float) -> bool:
        return now < self.until_s
