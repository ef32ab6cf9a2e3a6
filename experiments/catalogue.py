"""The metric catalogue of an ablation: every column of `results.csv`, what it means, and
when it may be NaN.

Owns: `METRICS` (name -> meaning, in table order), the per-SLA-class metric names, the
description columns, which metrics are not reproducible, and `undefined_reason` (the only
cases where a metric may be NaN; the tests enforce it, docs/experiments.md lists them).

Must never: compute anything from a run (that is `experiments.measure`).
"""

from __future__ import annotations

from typing import Any

NAN = float("nan")
LOSSY_MODES = ("swap_mixed",)

# Per-run metrics, in table order. Per-SLA-class columns (`sla{L}_*`) and any numeric
# `early_save_*` keys the engine reports are added after these.
METRICS: dict[str, str] = {
    "goodput_req_s": "requests that met their class's TTFT and TPOT SLOs, per simulated second",
    "slo_attainment": "share of requests that met their class's SLOs",
    "num_requests": "requests in the workload slice",
    "num_finished": "requests that finished",
    "num_aborted": "requests that could never run (too long for the model or the pool)",
    "ttft_p50_s": "time to first token, median (s)",
    "ttft_p99_s": "time to first token, p99 (s)",
    "tpot_p50_s": "time per output token after the first, median (s)",
    "tpot_p99_s": "time per output token after the first, p99 (s)",
    "num_preemptions": "requests taken out of the batch (priority + memory)",
    "num_priority_preemptions": "preemptions by the priority trigger",
    "num_memory_preemptions": "preemptions forced by running out of KV blocks",
    "num_reclaims": "paused requests whose blocks were reclaimed (KV saved then)",
    "peak_priority_preemptions_per_min": "most priority preemptions in any 60 s window",
    "num_preemption_failed": "requests marked PREEMPTION_FAILED (fallback)",
    "num_restore_fallbacks": "saved KV unusable on restore, recomputed instead",
    "preemption_stall_s": "compute time spent waiting for KV saves/restores (s)",
    "preemption_stall_save_s": "... of it waiting for saves' copy-out (s)",
    "preemption_stall_restore_s": "... of it waiting for restores (s)",
    "preemption_restore_wait_s": "time readmitted requests waited out of the batch for an asynchronous "
    "copy-in (s; the batch ran meanwhile; 0 with synchronous restores, whose wait is stall)",
    "stall_per_preemption_ms": "preemption_stall_s per preemption (ms)",
    "recomputed_tokens": "tokens of KV dropped by preemptions and computed again",
    "num_saves": "KV saves to the host pool that succeeded",
    "num_restores": "saved KV restored into device blocks",
    "kv_bytes_moved": "bytes over PCIe by saves and restores (raw KV; mixed: packed KV)",
    "kv_saved_bytes_raw": "KV bytes saved, before compression",
    "kv_saved_bytes_stored": "KV bytes stored in the host pool, after compression",
    "stored_over_raw": "kv_saved_bytes_stored / kv_saved_bytes_raw",
    "host_pool_peak_bytes": "peak host memory held by saved KV",
    "save_ms_p50": "save duration, decision to host copy complete, median (ms)",
    "save_ms_p99": "save duration, p99 (ms)",
    "restore_ms_p50": "restore duration, decision to blocks ready, median (ms)",
    "restore_ms_p99": "restore duration, p99 (ms)",
    "token_agreement": "greedy tokens equal to the quality reference's, over common lengths",
    "exact_match_share": "share of requests whose whole output equals the reference's",
    "num_early_saves": "speculative copies made by the early-save policy",
    "early_bytes_raw": "raw KV bytes copied early",
    "early_bytes_used": "... of them claimed by a later preemption (not copied again then)",
    "early_bytes_wasted": "... of them freed unused (the request finished, or evicted for space)",
    "early_save_precision": "early_bytes_used / early_bytes_raw: share of early copying a preemption used",
    "early_save_recall": "share of demand saves that found an early copy of the victim",
    "stall_share": "preemption_stall_s / sim_time_s: share of the run the GPU waited on KV moves",
    "sim_time_s": "simulated seconds until the last request ended",
    "wall_time_s": "wall seconds of the replay (the only non-reproducible column)",
}
SLA_METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment", "goodput_req_s")
DESCRIPTION_COLUMNS = (
    "run",
    "arm",
    "parent",
    "status",
    "change",
    "policy",
    "mode",
    "slices",
    "rate_cap",
    "early_save",
    "backend",
)
NOT_REPRODUCIBLE = ("wall_time_s",)
# summary.json keys newer than the Files contract: NaN when an engine does not report them.
ENGINE_REPORTED = (
    "preemption_stall_save_s",
    "preemption_stall_restore_s",
    "num_early_saves",
    "early_bytes_raw",
    "early_bytes_used",
    "early_bytes_wasted",
)


def undefined_reason(row: dict[str, Any], column: str) -> str | None:
    """Why `row[column]` may be NaN, or None if it must be a number: the documented
    cases (docs/experiments.md) and nothing else."""
    if row.get("status") != "ok":
        return f"arm {row.get('status')}"
    if column in ("early_save_precision", "early_save_recall"):
        if row.get("early_save") == "none":
            return "no early-save policy"
        if column == "early_save_precision" and not row.get("num_early_saves"):
            return "no early save was made"
        if column == "early_save_recall" and not row.get("num_saves"):
            return "no demand save"
    if column in ENGINE_REPORTED or (column.startswith("early_") and column not in METRICS):
        if row.get("mode") == "recompute" and column not in ENGINE_REPORTED[:2]:
            return "recompute mode: no saver, so no early saves"
        return "not reported by this engine version"
    if column in ("token_agreement", "exact_match_share"):
        return row.get("quality_note") or None
    if column == "stall_per_preemption_ms" and row["num_preemptions"] == 0:
        return "no preemptions"
    if column == "stored_over_raw" and row["kv_saved_bytes_raw"] == 0:
        return "nothing saved"
    if column.startswith("save_ms") and row["num_saves"] == 0:
        return "no saves"
    if column.startswith("restore_ms") and row["num_restores"] == 0:
        return "no restores"
    base = column.split("_", 1)[1] if column.startswith("sla") else column
    if base in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        return "no finished request (with more than one output token, for TPOT) in this class"
    if column.startswith("sla") and base in ("slo_attainment", "goodput_req_s"):
        return "no request of this class"
    return None
