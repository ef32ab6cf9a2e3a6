"""How far the logged features are from the ones the `lstm` policy reads online, when
restore prefetch is on (a known train/serve skew; docs/predictor.md).

Inside `Engine.step` the early saver (which computes the policy's features) runs before
the prefetcher, which then takes free blocks for the next admissions' copy-ins; the
feature logger is an `on_step` hook, so it reads the state after both. This replays one
window of experiments/configs/collect.yaml (raw swap, async restores, prefetch) and
computes each step's features at both points, with a `Features` source each; it prints
the rows that differ, per column. 0 rows would mean no skew.

Usage: python scripts/prefetch_skew.py [FEATURE_SET] [START_S]   (forecast, 0; ~30 s)
"""

from __future__ import annotations

import sys

import numpy as np

from preempt.bench.early import COLLECT
from preempt.core.config import load_config
from preempt.core.workload import build_workload
from preempt.engine.engine import Engine
from preempt.engine.features import FEATURE_SETS, Features


def main(feature_set: str = "forecast", start_s: str = "0") -> None:
    overrides = [f"workload.start_s={start_s}", "preemption.mode=swap", "preemption.async_restore=true"]
    overrides += ["early_save.prefetch=true"]
    config = load_config(COLLECT, overrides)
    engine = Engine(config)
    requests = build_workload(config.workload, seed=config.seed, vocab_size=engine.runner.vocab_size)
    online, logged = Features(feature_set, 50.0, 4), Features(feature_set, 50.0, 4)
    before: list[np.ndarray] = []
    after: list[np.ndarray] = []

    def read(source: Features, rows: list[np.ndarray], output) -> None:
        if output.finished:
            source.note_finished(output.finished)
        if output.scheduled.chunks and engine.view.running:
            rows.append(source(engine.view))

    prefetcher = engine.prefetcher
    step_prefetch = type(prefetcher).__call__

    def prefetch(self, view, output):  # the early saver's point: before this step's prefetch
        if self is prefetcher:  # not a lookahead fork's copy
            read(online, before, output)
        return step_prefetch(self, view, output)

    type(prefetcher).__call__ = prefetch
    try:
        engine.run(requests, on_step=lambda output: read(logged, after, output))
    finally:
        type(prefetcher).__call__ = step_prefetch
    a, b = np.concatenate(before), np.concatenate(after)
    differ = a != b
    per_column = dict(zip(FEATURE_SETS[feature_set], differ.sum(axis=0).tolist(), strict=True))
    num_rows = int(differ.any(axis=1).sum())
    print(f"{feature_set}, window from {start_s} s: {num_rows} of {len(a)} rows differ; {per_column}")


if __name__ == "__main__":
    main(*sys.argv[1:])
