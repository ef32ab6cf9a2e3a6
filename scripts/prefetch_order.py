"""The acceptance check of the order inside `Engine.step` with restore prefetch on: the
prefetcher (which takes free blocks for the next admissions' copy-ins) runs first, then
the early saver (where the `lstm` policy computes its features and the lookahead
policies fork); the feature logger, an `on_step` hook, reads the state after the step.
The policy must read what the logger trains on (until 2026-12-02 the early saver ran
before the prefetcher: 3,733 of 227,942 rows of [0, 200) s differed, and 2 of 3,327
oracle forecasts were wrong; docs/archive/predictor-history.md).

One replay of a window of preempt/configs/collect.yaml (raw swap, async restores,
prefetch, no early saves), reading the engine at both points of every step that ran
something, the early saver's (right after the prefetcher returns) and the logger's:
1. features: one `Features` source at each point; the rows that differ, per column (a
   train/serve skew: the logger trains on the second, the policy decides on the first);
2. the lookahead oracle (`--oracle`, slower: two forks a step): a fork at each point,
   each compared with the preemptions the live run then makes within the horizon (50 ms
   or 4 steps); the forecasts that differ. Both must be 0.

Usage: python scripts/prefetch_order.py [--oracle] [FEATURE_SET] [START_S] [DURATION_S]
(forecast, 0, 200; ~30 s, with --oracle use a short window: 20 s of trace ~1 min)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from preempt.bench.early import COLLECT
from preempt.core.config_files import load_config
from preempt.core.workload import build_workload
from preempt.early.features import FEATURE_SETS, Features
from preempt.early.lookahead import Lookahead
from preempt.engine.engine import Engine
from preempt.obs.dataset import preemption_events

HORIZON_MS, HORIZON_STEPS = 50.0, 4
POINTS = ("at the early saver", "at the feature logger")


def main(argv: list[str]) -> None:
    oracle = "--oracle" in argv
    args = [a for a in argv if a != "--oracle"]
    feature_set, start_s, duration_s = (args + ["forecast", "0", "200"][len(args) :])[:3]
    overrides = [f"workload.start_s={start_s}", f"workload.duration_s={duration_s}", "preemption.mode=swap"]
    overrides += ["preemption.async_restore=true", "early_save.prefetch=true"]
    config = load_config(COLLECT, overrides)
    engine = Engine(config)
    requests = build_workload(config.workload, seed=config.seed, vocab_size=engine.runner.vocab_size)
    sources = {point: Features(feature_set, HORIZON_MS, HORIZON_STEPS) for point in POINTS}
    lookaheads = {point: Lookahead(HORIZON_MS, HORIZON_STEPS) for point in POINTS}
    rows: dict[str, list[np.ndarray]] = {point: [] for point in POINTS}
    forecasts: dict[str, list[tuple[float, set[int]]]] = {point: [] for point in POINTS}
    step_ends: list[float] = []

    def read(point: str, output: Any) -> None:
        if output.finished:
            sources[point].note_finished(output.finished)
        view = engine.view
        if output.scheduled.chunks and view.running:
            rows[point].append(sources[point](view))
            if oracle:
                lookahead = lookaheads[point]
                forecasts[point].append((view.now, lookahead.within(lookahead.forecast(view))))

    prefetcher = engine.prefetcher
    step_prefetch = type(prefetcher).__call__

    def prefetch(self, view, output):
        result = step_prefetch(self, view, output)
        if self is prefetcher:  # not a lookahead fork's copy: the early saver runs next
            read(POINTS[0], output)
        return result

    def after(output: Any) -> None:
        if output.scheduled.chunks:
            step_ends.append(engine.view.now)
        read(POINTS[1], output)

    type(prefetcher).__call__ = prefetch
    try:
        engine.run(requests, on_step=after)
    finally:
        type(prefetcher).__call__ = step_prefetch
    a, b = (np.concatenate(rows[point]) for point in POINTS)
    differ = a != b
    per_column = dict(zip(FEATURE_SETS[feature_set], differ.sum(axis=0).tolist(), strict=True))
    num_rows = int(differ.any(axis=1).sum())
    print(f"{feature_set}, [{start_s}, +{duration_s}) s: {num_rows} of {len(a)} rows differ; {per_column}")
    if oracle:
        truth = _live_preemptions(engine, np.asarray(step_ends))
        for point in POINTS:
            wrong = sum(got != truth(t_s) for t_s, got in forecasts[point])
            total = len(forecasts[point])
            print(f"oracle forked {point}: {wrong} of {total} forecasts differ from the live run")


def _live_preemptions(engine: Engine, step_ends: np.ndarray):
    """t -> the requests the live run preempts within the horizon after time t, counted
    as `preempt.early.lookahead` counts (steps scheduled after t, or seconds)."""
    events = preemption_events(engine.scheduler.records)

    def truth(t_s: float) -> set[int]:
        out = set()
        for rid, times in events.items():
            later = times[times >= t_s - 1e-12]
            if len(later):
                steps = 1 + int(np.count_nonzero((step_ends > t_s + 1e-12) & (step_ends <= later[0] + 1e-12)))
                if later[0] - t_s <= HORIZON_MS / 1000 + 1e-9 or steps <= HORIZON_STEPS:
                    out.add(rid)
        return out

    return truth


if __name__ == "__main__":
    main(sys.argv[1:])
