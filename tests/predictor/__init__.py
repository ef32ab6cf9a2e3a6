"""Tests of the predictor package; `synthetic_dataset` writes a small features dataset
with a known, learnable signal (no engine run needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from preempt.early.features import FEATURE_NAMES
from preempt.obs.dataset import save_dataset

COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def synthetic_dataset(
    path: Path,
    num_requests: int = 120,
    seed: int = 0,
    running: int = 6,
    with_tokens: bool = False,
    window: tuple[str, float, float] | None = None,
) -> Path:
    """Requests run in overlapping groups of `running`; at each step the lowest-ranked one
    is preempted within the horizon when the KV pool is nearly full (plus 2% label noise).
    Every row is a plausible feature vector; labels follow the features of the row's step
    and the one before (free KV falling), so both the LSTM and the baselines can learn.
    `with_tokens`: also the `num_tokens` column (from seq_ktokens), for the expected value.
    `window`: (trace, start_s, duration_s), recorded as a collect's workload config is."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("request_id", "step", "t_s", "features", "label", "ttp")}
    step = 0
    for first in range(0, num_requests, running):
        ids = list(range(first, min(first + running, num_requests)))
        free = 0.5
        for _ in range(int(rng.integers(10, 30))):
            step += 1
            free = float(np.clip(free + rng.normal(-0.03, 0.08), 0.0, 1.0))
            ranks = rng.permutation(len(ids))
            for rid, rank in zip(ids, ranks, strict=True):
                x = np.zeros(8, np.float32)
                x[COL["num_preemptions"]] = rng.integers(0, 3)
                x[COL["seq_ktokens"]] = rng.uniform(0.05, 2.0)
                x[COL["slice_usage"]] = rng.uniform(0.0, 3.0)
                x[COL["score_rank"]] = rank
                x[COL["sla_level"]] = rng.integers(0, 3)
                x[COL["remaining_ktokens"]] = rng.uniform(0.0, 1.0)
                x[COL["queue_pressure"]] = rng.integers(0, 5)
                x[COL["free_kv_fraction"]] = free
                positive = (rank == 0 and free < 0.25) != (rng.random() < 0.02)
                rows["request_id"].append(rid)
                rows["step"].append(step)
                rows["t_s"].append(step * 0.01)
                rows["features"].append(x)
                rows["label"].append(int(positive))
                rows["ttp"].append(0.01 if positive else math.inf)
    columns = {
        "request_id": np.asarray(rows["request_id"], np.int64),
        "step": np.asarray(rows["step"], np.int64),
        "t_s": np.asarray(rows["t_s"], np.float64),
        "features": np.stack(rows["features"]),
        "label": np.asarray(rows["label"], np.int64),
        "time_to_preemption_s": np.asarray(rows["ttp"], np.float64),
    }
    if with_tokens:
        columns["num_tokens"] = (columns["features"][:, COL["seq_ktokens"]] * 1000).astype(np.int64)
    info: dict = {"seed": seed, "horizon_ms": 50.0, "trace": "synthetic"}
    if window is not None:
        trace, start, duration = window
        workload = {"trace": trace, "start_s": start, "duration_s": duration}
        info.update(trace=trace, config={"workload": workload})
    save_dataset(columns, info, path)
    return path
