"""Golden runs: a few fixed configs whose complete outputs (every requests.parquet row,
every preemptions.parquet row, the summary without wall-clock fields) are committed as
JSON. A refactor must leave them byte-identical; a change that is meant to alter
behaviour regenerates them and says so in its commit:

    .venv/bin/python -m tests.golden        # rewrites tests/golden/*.json
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent

_BASE = {
    "seed": 0,
    "model": {"backend": "null", "max_model_len": 16384, "num_threads": 1},
    "cache": {"block_size": 16, "num_blocks": 300},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048},
    "workload": {
        "trace": "azure-conv",
        "duration_s": 30,
        "rate_scale": 8.0,
        "sla_mix": {0: 0.7, 1: 0.2, 2: 0.1},
        # Pins the mechanisms on one fixed workload (not a policy comparison): each request's
        # max_tokens is its true length, as when these files were made.
        "max_tokens_mode": "trace",
    },
    "preemption": {
        "host_mem": "16GB",
        "slot_size": "1GB",
        "priority_weights": {"age": 0.05, "sla": 0.8, "tokens": 0.5},
    },
}

# name -> (section overrides). One per mechanism family, so each moves in one golden file.
CASES: dict[str, dict[str, Any]] = {
    "vllm_fcfs": {"scheduler": {"policy": "vllm_fcfs"}},
    "vllm_priority": {"scheduler": {"policy": "vllm_priority"}},
    "score_swap_zstd": {"scheduler": {"policy": "priority_score"}, "preemption": {"mode": "swap_zstd"}},
    "score_pause_quantum": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {"mode": "pause", "slice_mode": "quantum"},
    },
    "score_swap_mixed_early_rule": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {"mode": "swap_mixed"},
        "early_save": {"policy": "rule"},
    },
    "fastserve_mlfq": {
        "scheduler": {"policy": "fastserve_mlfq"},
        "preemption": {"mode": "pause", "reclaim_codec": "raw", "async_restore": True},
        "early_save": {"prefetch": True, "prefetch_depth": 16, "prefetch_block_share": 1.0},
    },
    "tiny_score_swap": {
        "cache": {"num_blocks": 90},
        "model": {"backend": "tiny", "dtype": "float32", "max_model_len": 1400},
        "workload": {"duration_s": 8},
        "scheduler": {"policy": "priority_score"},
        "preemption": {"mode": "swap"},
    },
}
# Not outputs: wall-clock fields measure this machine, and `config` echoes the input (a
# new config key with a default that changes nothing must not move a golden file).
_WALL = {"wall_time_s", "config"}


def case_config(name: str):
    from preempt.core.config import build_config

    data = json.loads(json.dumps(_BASE))
    for section, values in CASES[name].items():
        data.setdefault(section, {}).update(values)
    return build_config(data)


def _clean(value: Any) -> Any:
    """JSON-stable values: NaN/inf as strings, numpy scalars as Python, floats by repr."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def run_case(name: str) -> dict[str, Any]:
    """Replay the case; its whole observable output as one JSON-able dict."""
    import pyarrow.parquet as pq

    from preempt.replay import replay

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        summary = replay(case_config(name), out, progress=False)
        requests = pq.read_table(out / "requests.parquet").to_pylist()
        preemptions_path = out / "preemptions.parquet"
        preemptions = pq.read_table(preemptions_path).to_pylist() if preemptions_path.exists() else []
    summary = {k: v for k, v in summary.items() if k not in _WALL}
    return _clean({"summary": summary, "requests": requests, "preemptions": preemptions})


def golden_path(name: str) -> Path:
    return HERE / f"{name}.json"


def write_all() -> None:
    for name in CASES:
        golden_path(name).write_text(json.dumps(run_case(name), indent=0, sort_keys=True) + "\n")
        print(name)
