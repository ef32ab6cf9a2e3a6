"""Metrics of one run, read back from its files (`summary.json`, `preemptions.parquet`).

Owns: `run_metrics`, which turns one run directory into the row of metrics the catalogue
(`experiments.catalogue.METRICS`) describes.

Must never: write anything, or depend on other runs (output quality against a reference
is `experiments.quality`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from experiments.catalogue import ENGINE_REPORTED, NAN, SLA_METRICS
from preempt.core.limits import RATE_WINDOW_S
from preempt.kv.record import is_preemption


def _percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else NAN


def _peak_in_window(times: list[float], window_s: float = RATE_WINDOW_S) -> int:
    """Most events in any half-open window (t - window_s, t]."""
    times = sorted(times)
    peak, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window_s:
            lo += 1
        peak = max(peak, hi - lo + 1)
    return peak


def _nan_if_none(value: Any) -> float:
    return NAN if value is None else float(value)


def run_metrics(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The table's metrics of one run, from its summary.json and preemptions.parquet."""
    rec = pq.read_table(run_dir / "preemptions.parquet").to_pylist()
    preempted = [r for r in rec if is_preemption(r["reason"], r["action"])]
    saves = [r for r in rec if r["action"] == "save" and r["failure"] is None and r["bytes_raw"] > 0]
    restores = [r for r in saves if r["restored"]]
    recomputed = sum(r["num_tokens"] for r in rec if r["action"] == "recompute" or r["restored"] is False)

    raw, stored = int(summary["kv_saved_bytes_raw"]), int(summary["kv_saved_bytes_stored"])

    # Bytes over PCIe: raw and zstd move raw KV (zstd runs on the host); mixed quantizes on
    # the device first, so its packed share crosses (the run's stored/raw, scales included).
    packed = stored / raw if raw else 1.0

    def moved(r: dict[str, Any], early: int = 0) -> float:
        return (r["bytes_raw"] + early) * (packed if r["codec"] == "mixed" else 1.0)

    early_codec_ratio = packed if summary["config"]["preemption"]["mode"] == "swap_mixed" else 1.0
    bytes_moved = (
        sum(moved(r) for r in saves)
        + sum(moved(r, r.get("bytes_early") or 0) for r in restores)  # a restore brings it all back
        + summary.get("early_bytes_raw", 0) * early_codec_ratio
    )
    early_policy = summary["config"]["early_save"]["policy"]
    early_raw = summary.get("early_bytes_raw", 0)
    precision = summary.get("early_bytes_used", 0) / early_raw if early_raw else NAN
    recall = sum(bool(r.get("bytes_early")) for r in saves) / len(saves) if saves else NAN
    if early_policy == "none":
        precision = recall = NAN

    num_preemptions = int(summary["num_preemptions"])
    out: dict[str, Any] = {
        "goodput_req_s": float(summary["goodput_req_s"]),
        "slo_attainment": _nan_if_none(summary["slo_attainment"]),
        "num_requests": int(summary["num_requests"]),
        "num_finished": int(summary["num_finished"]),
        "num_aborted": int(summary["num_aborted"]),
        **{k: _nan_if_none(summary[k]) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")},
        "num_preemptions": num_preemptions,
        "num_priority_preemptions": sum(r["reason"] == "priority" for r in preempted),
        "num_memory_preemptions": sum(r["reason"] == "memory" for r in preempted),
        "num_reclaims": sum(r["reason"] == "reclaim" for r in rec),
        "peak_priority_preemptions_per_min": _peak_in_window(
            [r["time_s"] for r in preempted if r["reason"] == "priority"]
        ),
        "num_preemption_failed": int(summary["num_preemption_failed"]),
        "num_restore_fallbacks": int(summary.get("num_restore_fallbacks", 0)),
        "preemption_stall_s": float(summary["preemption_stall_s"]),
        # Async restores (preemption.async_restore): reported only with the switch on.
        "preemption_restore_wait_s": float(summary.get("preemption_restore_wait_s", 0.0)),
        "stall_per_preemption_ms": (
            summary["preemption_stall_s"] / num_preemptions * 1e3 if num_preemptions else NAN
        ),
        "recomputed_tokens": int(recomputed),
        "num_saves": len(saves),
        "num_restores": len(restores),
        "kv_bytes_moved": int(bytes_moved),
        "kv_saved_bytes_raw": raw,
        "kv_saved_bytes_stored": stored,
        "stored_over_raw": stored / raw if raw else NAN,
        "host_pool_peak_bytes": int(summary.get("host_pool_peak_bytes", 0)),
        "save_ms_p50": _percentile_ms([r["save_s"] for r in saves], 50),
        "save_ms_p99": _percentile_ms([r["save_s"] for r in saves], 99),
        "restore_ms_p50": _percentile_ms([r["restore_s"] for r in restores], 50),
        "restore_ms_p99": _percentile_ms([r["restore_s"] for r in restores], 99),
        "token_agreement": NAN,  # filled against the quality reference once both ran
        "exact_match_share": NAN,
        **{key: _nan_if_none(summary.get(key)) for key in ENGINE_REPORTED},
        "early_save_precision": precision,
        "early_save_recall": recall,
        "stall_share": (
            summary["preemption_stall_s"] / summary["sim_time_s"] if summary["sim_time_s"] > 0 else NAN
        ),
        "sim_time_s": float(summary["sim_time_s"]),
        "wall_time_s": float(summary["wall_time_s"]),
    }
    for key, value in summary.items():  # whatever else the early-save engine reports
        if key.startswith("early_") and isinstance(value, int | float) and key not in out:
            out[key] = float(value)
    for level, stats in sorted(summary["per_sla"].items(), key=lambda kv: int(kv[0])):
        for name in SLA_METRICS:
            if name == "goodput_req_s":  # per class: its requests within SLO per simulated second
                sim_s = summary["sim_time_s"]
                out[f"sla{level}_{name}"] = stats["num_slo_met"] / sim_s if sim_s > 0 else 0.0
            else:
                out[f"sla{level}_{name}"] = _nan_if_none(stats[name])
    return out
