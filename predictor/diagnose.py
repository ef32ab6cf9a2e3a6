"""What a trace's labels let any predictor know: `python -m predictor.diagnose RUN FEATURES`.

Owns one question (asked first of mooncake-synthetic): how many positive rows were logged
before the cause of their preemption existed. A priority preemption is triggered by its
challenger; a row logged before the challenger arrived cannot know of it from any
feature, so such rows bound every predictor's recall at a precision above the base
rate (and with it AUPRC). Reads a run's `preemptions.parquet` and `requests.parquet`
(`preempt collect --out RUN`) and its features dataset (`--features FEATURES`).

Must never: be imported by `preempt/` (it reads pandas and datasets), or feed anything
back into training (it reads the labels and the future on purpose).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def challenger_timing(run_dir: str | Path, features_dir: str | Path) -> dict[str, Any]:
    import datasets
    import pandas as pd

    run_dir = Path(run_dir)
    records = pd.read_parquet(run_dir / "preemptions.parquet")
    records = records[records.action != "none"]  # kept running: not a preemption
    arrival = pd.read_parquet(run_dir / "requests.parquet").set_index("request_id").arrival_s
    table = datasets.load_from_disk(str(features_dir)).with_format("numpy")[:]
    positive = table["label"] == 1
    t_s, time_to = table["t_s"][positive], table["time_to_preemption_s"][positive]
    request_id = table["request_id"][positive]
    event_s = t_s + time_to
    by_request = {rid: group for rid, group in records.groupby("request_id")}
    before = np.zeros(len(t_s), dtype=bool)
    priority = np.zeros(len(t_s), dtype=bool)
    for i, (rid, event) in enumerate(zip(request_id, event_s, strict=True)):
        group = by_request[int(rid)]
        record = group.iloc[int(np.argmin(np.abs(group.time_s.to_numpy() - event)))]
        if record.reason == "priority" and record.challenger_id == record.challenger_id:  # not NaN
            priority[i] = True
            before[i] = t_s[i] < arrival[int(record.challenger_id)]
    wait = records[records.reason == "priority"]
    wait_ms = 1e3 * (wait.time_s.to_numpy() - arrival[wait.challenger_id.astype(int)].to_numpy())
    num_positive = int(positive.sum())
    return {
        "num_positive_rows": num_positive,
        "priority_share_of_positive_rows": float(priority.mean()) if num_positive else None,
        "logged_before_challenger_arrived": float(before.mean()) if num_positive else None,
        "time_to_preemption_positive_share": float((time_to > 0).mean()) if num_positive else None,
        "challenger_wait_ms_p50_p90_max": [round(float(v), 1) for v in np.percentile(wait_ms, [50, 90, 100])]
        if len(wait_ms)
        else None,
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m predictor.diagnose RUN_DIR FEATURES_DIR")
    print(json.dumps(challenger_timing(sys.argv[1], sys.argv[2]), indent=2))
