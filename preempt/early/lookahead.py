"""The lookahead oracle: fork the engine's state and simulate ahead to learn who really is
preempted within the horizon.

Uses `Engine.fork` (a deep copy of the live engine's scheduler, block pool, saver
timelines, clock and requests, with a no-compute runner and no early saver); owns
`Lookahead`, which steps such a fork through the next `horizon_ms` / `horizon_steps`
(the trace's upcoming arrivals included, as `Engine.run` would add them) and returns the
preemptions the current policy makes there. The clock is virtual and the engine
deterministic, so without further early saves the live engine follows the fork step for
step: its forecast is the truth, an upper bound measured in the same run as the
predictors (a test checks it against the live run's records).

`knows_future=False` makes the same fork a *forecast* from what a server knows now: no
request that has not arrived yet, and every request runs to its `max_tokens` (never the
trace's true length). That is the `forecast` early-save policy: a point prediction of
what the present state implies if nothing new arrives, not a bound (a learned predictor
can anticipate arrivals it cannot). It reads nothing a server lacks, but like the
oracle it runs on the virtual clock only.

Must never: touch the live engine (everything the fork mutates is its own copy; a test
runs with and without it and compares every output), run model compute (the fork's
runner emits placeholder tokens; requests end by length, as in trace replay), or run
on the wall clock (a fork cannot replay real time).

Where the fork is not exact: with the `tiny` backend the fork's saver has no KV data,
so host-pool bytes are the modelled ones (exact with the `null` backend, which the
benchmarks use); a request that would stop on a sampled stop token stops by length.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from preempt.core.request import Request
    from preempt.engine.view import EngineView


class Forecast(NamedTuple):
    """What the fork saw: request_id -> (seconds, steps) from now to its first preemption
    within the horizon, and how far the fork ran."""

    preempted: dict[int, tuple[float, int]]
    num_steps: int
    span_s: float


class Horizon:
    """How far a forecast looks: `horizon_ms` and `horizon_steps`, whichever is longer
    (the predictor's labels count both, preempt.obs.dataset.label_rows)."""

    def __init__(self, horizon_ms: float, horizon_steps: int = 0) -> None:
        if not horizon_ms > 0:
            raise ValueError(f"horizon_ms must be > 0, got {horizon_ms}")
        if horizon_steps < 0:
            raise ValueError(f"horizon_steps must be >= 0, got {horizon_steps}")
        self.horizon_s = horizon_ms / 1000.0
        self.horizon_steps = horizon_steps

    def within(self, forecast: Forecast) -> set[int]:
        """Request ids preempted within the horizon (time or steps, whichever is longer)."""
        return {
            rid
            for rid, (dt, steps) in forecast.preempted.items()
            if dt <= self.horizon_s + 1e-9 or steps <= self.horizon_steps
        }


class Lookahead(Horizon):
    """Forecasts preemptions by simulating a fork of the engine ahead."""

    def __init__(self, horizon_ms: float, horizon_steps: int = 0, knows_future: bool = True) -> None:
        super().__init__(horizon_ms, horizon_steps)
        self.knows_future = knows_future
        self.num_forks = 0
        self.num_fork_steps = 0
        self.wall_s = 0.0  # wall time spent forking and simulating (the policy's cost)

    def forecast(self, view: EngineView) -> Forecast:
        """Run a fork until both horizons have passed (or nothing is left to run): a
        preemption decided at the k-th step's schedule() is k steps and (its time - now)
        seconds ahead, as `preempt.obs.dataset.label_rows` counts them."""
        started = time.perf_counter()
        fork = view.fork()
        self.num_forks += 1
        start_s = fork.clock.now()
        start_step = fork.num_steps
        if self.knows_future:
            upcoming = view.upcoming_arrivals(start_s + self.horizon_s + 3600.0)
        else:
            # Arrived by now (a server holds them, queued or not); lengths from max_tokens.
            upcoming = view.upcoming_arrivals(start_s)
            for request in fork.scheduler.unfinished_requests():
                request.target_output_tokens = request.max_tokens
        next_arrival = 0
        preempted: dict[int, tuple[float, int]] = {}
        while True:
            now = fork.clock.now()
            steps_ahead = fork.num_steps - start_step + 1  # the step about to be scheduled
            if now - start_s > self.horizon_s + 1e-9 and steps_ahead > self.horizon_steps:
                break
            while next_arrival < len(upcoming) and upcoming[next_arrival].arrival_s <= now:
                request = copy.deepcopy(upcoming[next_arrival])  # the prompt array shared
                if not self.knows_future:
                    request.target_output_tokens = request.max_tokens
                fork.add_request(request)
                next_arrival += 1
            if not fork.scheduler.has_unfinished:
                if (
                    next_arrival < len(upcoming)
                    and upcoming[next_arrival].arrival_s - start_s <= self.horizon_s
                ):
                    fork.clock.wait_until(upcoming[next_arrival].arrival_s)
                    continue
                break
            output = fork.step()
            self.num_fork_steps += 1
            for record in output.scheduled.records:
                if record.is_preemption:  # as label_rows' events
                    preempted.setdefault(record.request_id, (record.time_s - start_s, steps_ahead))
            if not output.scheduled.chunks and not output.scheduled.preempted:
                if fork.scheduler.backoff_until_s > fork.clock.now():
                    fork.clock.wait_until(fork.scheduler.backoff_until_s)
                    continue
                break
        self.wall_s += time.perf_counter() - started
        return Forecast(preempted, fork.num_steps - start_step, fork.clock.now() - start_s)


class RollingForecast:
    """A `Lookahead`'s forecast kept current along a run: forked again at every
    `every_steps`-th call of `update` (its callers call it after each step that ran
    something they decide on), and, for a forecast (`knows_future=False`), at once on
    news its last fork could not know: a request arrived, or one ended before its
    `max_tokens` (the fork ran every request to max_tokens). Until such news, and
    without early saves (whose copies shift stalls and so the virtual clock), the
    scheduler follows the fork step for step, so its picks stand in between; the fork's
    horizon starts at the fork, so calls after it see less of the horizon ahead.

    Read by the `lookahead` / `forecast` early-save policies (`chosen`) and by the
    `forecast` feature set (`steps_until`)."""

    def __init__(self, lookahead: Lookahead, every_steps: int = 1) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.lookahead = lookahead
        self.every_steps = every_steps
        self.chosen: set[int] = set()  # preempted within the horizon by the last fork
        self._preempted_at: dict[int, int] = {}  # their engine step (the schedule that preempts)
        self._calls_since_fork: int | None = None  # None: never forked
        self._num_arrived = 0
        self._news = False

    def note_finished(self, requests: Iterable[Request]) -> None:
        """These requests left for good; one that ended before its `max_tokens` is news."""
        if not self.lookahead.knows_future:
            self._news |= any(r.num_output_tokens < r.max_tokens for r in requests)

    def update(self, view: EngineView) -> None:
        """Fork again if this is the `every_steps`-th call since the last fork, or on news."""
        if not self.lookahead.knows_future and view.num_arrived != self._num_arrived:
            self._news = True
        if self._calls_since_fork is not None:
            self._calls_since_fork += 1
            if self._calls_since_fork < self.every_steps and not self._news:
                return
        forecast = self.lookahead.forecast(view)
        self.chosen = self.lookahead.within(forecast)
        # steps ahead k: the preemption is decided by the schedule of engine step n + k.
        self._preempted_at = {rid: view.num_steps + forecast.preempted[rid][1] for rid in self.chosen}
        self._calls_since_fork = 0
        self._num_arrived = view.num_arrived
        self._news = False

    def steps_until(self, request_id: int, num_steps: int) -> int | None:
        """Engine steps from step `num_steps` until the last fork preempts this request;
        None when the fork does not preempt it within the horizon, or did so at a step
        already run (the request was preempted then and is back, or the fork was wrong:
        either way it says nothing of what comes)."""
        at = self._preempted_at.get(request_id)
        return None if at is None or at <= num_steps else at - num_steps
