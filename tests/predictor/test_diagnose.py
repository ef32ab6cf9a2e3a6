"""predictor.diagnose on a hand-made run: which positive rows were logged before the
challenger of their preemption arrived."""

from __future__ import annotations

import numpy as np
import pandas as pd

from predictor.diagnose import challenger_timing
from preempt.obs.dataset import save_dataset


def test_rows_before_the_challenger_arrived(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # Request 1 is preempted for priority at t=1.0 by request 9 (arrived at 0.995); request
    # 2 for memory at t=2.0 (no challenger). Request 3 is preempted but kept running.
    pd.DataFrame(
        {
            "time_s": [1.0, 2.0, 1.5],
            "request_id": [1, 2, 3],
            "reason": ["priority", "memory", "priority"],
            "action": ["save", "save", "none"],
            "challenger_id": [9.0, np.nan, 9.0],
        }
    ).to_parquet(run / "preemptions.parquet")
    pd.DataFrame({"request_id": [1, 2, 3, 9], "arrival_s": [0.0, 0.0, 0.0, 0.995]}).to_parquet(
        run / "requests.parquet"
    )
    t_s = np.array([0.96, 0.98, 0.999, 1.2, 1.96, 1.98, 1.46])
    rid = np.array([1, 1, 1, 1, 2, 2, 3])
    ttp = np.array([0.04, 0.02, 0.001, np.inf, 0.04, 0.02, np.inf])
    columns = {
        "request_id": rid,
        "step": np.arange(len(rid)),
        "t_s": t_s,
        "features": np.zeros((len(rid), 8), np.float32),
        "label": np.isfinite(ttp).astype(np.int64),
        "time_to_preemption_s": ttp,
    }
    features = tmp_path / "features"
    save_dataset(columns, {"trace": "hand", "seed": 0, "horizon_ms": 50.0}, features)
    out = challenger_timing(run, features)
    assert out["num_positive_rows"] == 5
    assert out["priority_share_of_positive_rows"] == 3 / 5
    assert out["logged_before_challenger_arrived"] == 2 / 5  # 0.96 and 0.98, not 0.999
    assert out["challenger_wait_ms_p50_p90_max"] == [5.0, 5.0, 5.0]
