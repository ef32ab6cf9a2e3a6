"""Running an ablation: `preempt ablate --config experiments/configs/NAME.yaml --out DIR`.

Owns: executing a plan from `experiments.arms` (arms in spawned worker processes, one
torch thread each, references before the arms that replay them), the per-arm metrics
read back from each run's files, the results table (`DIR/results.csv`,
`DIR/results.md`), `DIR/ablation.json` (what ran, with which configs, at which commit),
and the one seam to wandb (`_WandbSink`: one run per arm in one group, plus a summary
run with the table and the plots).

Must never: block on the network (wandb is offline unless asked for online or an API key
is set, and an online start that fails falls back to offline), import pytorch_lightning,
or change an arm's config after planning (runs are reproducible: same config + seed =>
same metrics on the virtual clock; only `wall_time_s` varies).

Layout of DIR:
    ablation.json, results.csv, results.md, plots/*.png, wandb/ (WANDB_DIR)
    arms/<run>/requests.parquet, summary.json, preemptions.parquet, metrics.json

Metrics are NaN only where undefined; `undefined_reason` says when (and the docs list it).
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from experiments.arms import AblationPlan, ArmRun, plan_ablation
from preempt.tracking import resolve_wandb_mode

NAN = float("nan")
ONLINE_INIT_TIMEOUT_S = 15.0
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
    "sim_time_s": "simulated seconds until the last request ended",
    "wall_time_s": "wall seconds of the replay (the only non-reproducible column)",
}
SLA_METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment")
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
    if column.startswith("sla") and base == "slo_attainment":
        return "no request of this class"
    return None


# ---------------------------------------------------------------- metrics of one run


def _percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else NAN


def _peak_in_window(times: list[float], window_s: float = 60.0) -> int:
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
    preempted = [r for r in rec if r["reason"] in ("priority", "memory") and r["action"] != "none"]
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
        "sim_time_s": float(summary["sim_time_s"]),
        "wall_time_s": float(summary["wall_time_s"]),
    }
    for key, value in summary.items():  # whatever else the early-save engine reports
        if key.startswith("early_") and isinstance(value, int | float) and key not in out:
            out[key] = float(value)
    for level, stats in sorted(summary["per_sla"].items(), key=lambda kv: int(kv[0])):
        for name in SLA_METRICS:
            out[f"sla{level}_{name}"] = _nan_if_none(stats[name])
    return out


def output_agreement(run_dir: Path, reference_dir: Path) -> tuple[float, float, int]:
    """(token agreement, exact-match share, requests compared) of this run's greedy outputs
    against the reference's, over requests that finished in both. Token agreement counts
    equal tokens position by position over each pair's common length (a lossy restore
    that flips one token usually changes the rest, so this is a strict measure)."""
    columns = ["request_id", "final_state", "output_token_ids"]
    mine = pq.read_table(run_dir / "requests.parquet", columns=columns).to_pydict()
    ref = pq.read_table(reference_dir / "requests.parquet", columns=columns).to_pydict()
    ref_tokens = {
        rid: tokens for rid, state, tokens in zip(*ref.values(), strict=True) if state == "FINISHED"
    }
    num_equal = num_common = num_exact = num_compared = 0
    for rid, state, tokens in zip(*mine.values(), strict=True):
        if state != "FINISHED" or rid not in ref_tokens:
            continue
        a, b = np.asarray(tokens), np.asarray(ref_tokens[rid])
        common = min(len(a), len(b))
        num_equal += int((a[:common] == b[:common]).sum())
        num_common += common
        num_exact += len(a) == len(b) and bool((a == b).all())
        num_compared += 1
    if not num_compared:
        return NAN, NAN, 0
    return (num_equal / num_common if num_common else NAN), num_exact / num_compared, num_compared


# ---------------------------------------------------------------- one arm (in a worker)


def _init_worker() -> None:
    # Arms run side by side, one per core: a second OpenMP thread per process would
    # fight the other arms for the same cores (measured: several times slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def run_arm(key: str, config_json: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Replay one arm into `run_dir` and return {"status", "metrics" | "error"}. Runs in a
    worker process; errors come back as values so one broken arm cannot lose the rest."""
    from preempt.config import build_config
    from preempt.replay import replay

    try:
        config = build_config(config_json)
        path = Path(run_dir)
        summary = replay(config, path, progress=False)
        metrics = run_metrics(path, summary)
        (path / "metrics.json").write_text(
            json.dumps({"run": key, "config": config_json, "metrics": _jsonable(metrics)}, indent=1) + "\n"
        )
        return {"status": "ok", "metrics": metrics}
    except Exception as err:  # reported in the table and by the exit status
        return {"status": "failed", "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}


def _reused(run: ArmRun, run_dir: Path) -> dict[str, Any] | None:
    """`--resume`: the metrics of an earlier run of exactly this config, if any."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("config") != run.config.model_dump(mode="json"):
        return None
    return {"status": "ok", "metrics": {k: NAN if v is None else v for k, v in saved["metrics"].items()}}


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


def default_jobs(num_runs: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, num_runs))


def execute(
    plan: AblationPlan,
    out_dir: Path,
    jobs: int,
    *,
    resume: bool = False,
    on_done: Callable[[ArmRun, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every non-skipped arm; returns run key -> outcome. Arms whose reference has not
    finished wait for it; with a failed reference they are skipped. jobs=1 runs in this
    process (no spawn cost); more use a spawn-context process pool."""
    outcomes: dict[str, dict[str, Any]] = {}
    todo = [run for run in plan.runs if run.skip_reason is None]
    for run in plan.runs:
        if run.skip_reason is not None:
            outcomes[run.key] = {"status": "skipped", "error": run.skip_reason}

    def finish(run: ArmRun, outcome: dict[str, Any]) -> None:
        outcomes[run.key] = outcome
        if on_done is not None:
            on_done(run, outcome)

    def ready(run: ArmRun) -> bool:
        return run.reference is None or run.reference in outcomes

    def reference_failed(run: ArmRun) -> str | None:
        ref = outcomes.get(run.reference) if run.reference else None
        if ref is not None and ref["status"] != "ok":
            return f"reference arm '{run.reference}' {ref['status']}"
        return None

    def start(run: ArmRun, submit: Callable[..., Any]) -> Any:
        run_dir = out_dir / "arms" / run.key
        if (failed := reference_failed(run)) is not None:
            finish(run, {"status": "skipped", "error": failed})
            return None
        if resume and (outcome := _reused(run, run_dir)) is not None:
            finish(run, outcome)
            return None
        return submit(run_arm, run.key, run.config.model_dump(mode="json"), str(run_dir))

    if jobs <= 1:
        _init_worker()
        pending = list(todo)
        while pending:
            run = next(r for r in pending if ready(r))
            pending.remove(run)
            result = start(run, lambda fn, *args: fn(*args))
            if result is not None:
                finish(run, result)
        return outcomes

    context = multiprocessing.get_context("spawn")  # fork + torch threads can deadlock
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker) as pool:
        futures: dict[Future, ArmRun] = {}
        pending = list(todo)
        while pending or futures:
            for run in [r for r in pending if ready(r)]:
                pending.remove(run)
                future = start(run, pool.submit)
                if future is not None:
                    futures[future] = run
            if not futures:
                continue  # started nothing, but finishing made more runs ready
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                run = futures.pop(future)
                try:
                    finish(run, future.result())
                except Exception as err:  # the worker itself died (e.g. killed for memory)
                    finish(run, {"status": "failed", "error": f"worker died: {err}"})
    return outcomes


# ---------------------------------------------------------------- the table


def _change(run: ArmRun) -> str:
    return "; ".join(f"{k}={v}" for k, v in run.own_set.items()) or "(base)"


def results_rows(plan: AblationPlan, out_dir: Path, outcomes: dict[str, dict[str, Any]]) -> list[dict]:
    """One row per run: what it is, its status and its metrics; output quality against
    the quality reference; notes (no effect vs the parent, lossless arm that changed
    outputs)."""
    reference = plan.config.quality_reference
    rows: list[dict[str, Any]] = []
    metric_columns = list(METRICS)
    for outcome in outcomes.values():
        for key in outcome.get("metrics", {}):
            if key not in metric_columns:
                metric_columns.append(key)
    for run in plan.runs:
        outcome = outcomes[run.key]
        cfg = run.config
        row: dict[str, Any] = {
            "run": run.key,
            "arm": run.arm,
            "parent": run.parent or "",
            "status": outcome["status"],
            "change": _change(run),
            "policy": cfg.scheduler.policy,
            "mode": cfg.preemption.mode,
            "slices": cfg.preemption.time_slice_strategy,
            "rate_cap": str(cfg.preemption.max_preemption_per_min or "none"),
            "early_save": cfg.early_save.policy,
            "backend": cfg.model.backend,
            **{key.rsplit(".", 1)[-1]: value for key, value in run.grid_point.items()},
        }
        metrics = outcome.get("metrics", {})
        row.update({column: metrics.get(column, NAN) for column in metric_columns})
        notes = [outcome["error"]] if outcome.get("error") else []
        row["quality_note"] = ""
        if outcome["status"] == "ok":
            row["quality_note"] = _score_quality(plan, run, out_dir, outcomes, reference, row)
            if cfg.preemption.mode not in LOSSY_MODES and row["token_agreement"] < 1.0:
                notes.append("outputs differ from the reference although this arm's mode is lossless")
        row["notes"] = notes
        rows.append(row)
    _note_no_effect(rows)
    for row in rows:
        row["notes"] = " | ".join(row["notes"])
    return rows


def _score_quality(
    plan: AblationPlan,
    run: ArmRun,
    out_dir: Path,
    outcomes: dict[str, dict[str, Any]],
    reference: str | None,
    row: dict[str, Any],
) -> str:
    """Fill token_agreement / exact_match_share; returns why they stay NaN ('' if not)."""
    if run.config.model.backend == "null":
        return "null backend: no real tokens (outputs are placeholders, equal by construction)"
    if reference is None:
        return "no quality_reference in the ablation config"
    from experiments.arms import run_key

    ref_key = run_key(reference, run.grid_point)
    if ref_key == run.key:
        return "the quality reference itself"
    if outcomes.get(ref_key, {}).get("status") != "ok":
        return f"quality reference '{ref_key}' did not run"
    agreement, exact, num = output_agreement(out_dir / "arms" / run.key, out_dir / "arms" / ref_key)
    row["token_agreement"], row["exact_match_share"] = agreement, exact
    return "" if num else "no request finished in both runs"


def metric_fingerprint(row: dict[str, Any]) -> tuple:
    return tuple(
        (k, None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in row.items()
        if k in METRICS and k not in NOT_REPRODUCIBLE
    )


def _note_no_effect(rows: list[dict[str, Any]]) -> None:
    by_run = {row["run"]: row for row in rows}
    for row in rows:
        parent = by_run.get(row["parent"]) if row["parent"] else None
        if parent is None or row["status"] != "ok" or parent["status"] != "ok":
            continue
        if metric_fingerprint(row) == metric_fingerprint(parent):
            row["notes"].append(
                f"same metrics as its parent '{parent['run']}': the change had no effect on this "
                "workload, or the engine does not act on it yet"
            )


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return value


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """results.csv back into rows, numbers as numbers (NaN as float nan)."""

    def parse(value: str) -> Any:
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return value

    with path.open(newline="") as handle:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def fmt(value: Any, column: str = "") -> str:
    """A table cell: bytes humanized, floats to 3 significant digits, NaN as '–'."""
    if isinstance(value, float) and math.isnan(value):
        return "–"
    if isinstance(value, int | float) and "bytes" in column:
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= size:
                return f"{value / size:.3g} {unit}"
        return f"{int(value)} B"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


MD_COLUMNS = (
    ("run", "run"),
    ("goodput_req_s", "goodput req/s"),
    ("slo_attainment", "SLO att."),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tpot_p99_s", "TPOT p99 s"),
    ("num_preemptions", "preempt."),
    ("num_preemption_failed", "failed"),
    ("recomputed_tokens", "recomp. tok"),
    ("preemption_stall_s", "stall s"),
    ("stall_per_preemption_ms", "stall/preempt ms"),
    ("kv_bytes_moved", "moved"),
    ("kv_saved_bytes_stored", "stored"),
    ("stored_over_raw", "stored/raw"),
    ("host_pool_peak_bytes", "host peak"),
    ("save_ms_p50", "save ms p50"),
    ("restore_ms_p50", "restore ms p50"),
    ("token_agreement", "token agr."),
    ("exact_match_share", "exact"),
)


def markdown_table(rows: list[dict[str, Any]], columns: Iterable[tuple[str, str]]) -> str:
    columns = [(key, title) for key, title in columns if any(key in row for row in rows)]
    lines = [
        "| " + " | ".join(title for _, title in columns) + " |",
        "|" + "|".join(" --- " if key in ("run", "change") else " ---: " for key, _ in columns) + "|",
    ]
    for row in rows:
        cells = [fmt(row.get(key, NAN), key).replace("|", "\\|") for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sla_levels(rows: list[dict[str, Any]]) -> list[str]:
    levels = {k[3:].split("_", 1)[0] for row in rows for k in row if k.startswith("sla") and k[3:4].isdigit()}
    return sorted(levels, key=int)


def sla_table(rows: list[dict[str, Any]]) -> str:
    """TTFT p50/p99, TPOT p99 and SLO attainment per SLA class, one row per run."""
    columns = [("run", "run")]
    for level in sla_levels(rows):
        columns += [
            (f"sla{level}_ttft_p50_s", f"L{level} TTFT p50"),
            (f"sla{level}_ttft_p99_s", f"L{level} TTFT p99"),
            (f"sla{level}_tpot_p99_s", f"L{level} TPOT p99"),
            (f"sla{level}_slo_attainment", f"L{level} SLO att."),
        ]
    return markdown_table(rows, columns)


def results_markdown(plan_info: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """DIR/results.md: the main table, per-SLA-class latencies, what each arm changes, notes."""
    lines = [
        f"# Ablation `{plan_info['name']}`",
        "",
        plan_info.get("description", "").strip(),
        "",
        f"Config `{plan_info['source']}`, commit `{plan_info.get('git_rev', '?')}`, "
        f"{len(rows)} runs, {plan_info.get('wall_s', 0):.0f} s wall with {plan_info.get('jobs')} jobs. "
        "Times are on the virtual clock (cost model of the target), so they are reproducible; "
        "'–' marks a metric that is undefined for that run (docs/experiments.md).",
        "",
        markdown_table(rows, MD_COLUMNS),
        "",
        "## Latency per SLA class (higher level = more important)",
        "",
    ]
    lines += [sla_table(rows), "", "## Arms", ""]
    lines += [markdown_table(rows, [("run", "run"), ("parent", "parent"), ("change", "change")]), ""]
    notes = [(row["run"], row["notes"]) for row in rows if row.get("notes")]
    if notes:
        lines += ["## Notes", ""] + [f"- `{run}`: {note}" for run, note in notes] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- wandb


class _WandbSink:
    """The seam to wandb: `arm(...)` logs one run per arm (config = the resolved engine
    config, summary = its metrics), `summary(...)` one run with the results table
    (wandb.Table) and the plots (wandb.Image), all in one group under DIR/wandb. With
    mode `disabled` it does nothing and never imports wandb."""

    def __init__(self, mode: str, out_dir: Path, project: str, group: str) -> None:
        self.mode, self.out_dir, self.project, self.group = mode, out_dir, project, group
        self.num_runs = 0
        self._saved_env: dict[str, str | None] = {}
        if mode == "disabled":
            return
        # Everything wandb writes (runs, its own logs) goes under DIR, for this command only.
        for name, value in (("WANDB_DIR", str(out_dir)), ("WANDB_SILENT", "true")):
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        import wandb

        self.wandb = wandb
        # console off: the CLI's own output stays readable; no stats sampler for short runs.
        self.settings = dict(
            silent=True, console="off", x_disable_stats=True, init_timeout=ONLINE_INIT_TIMEOUT_S
        )

    def _init(self, **kwargs: Any) -> Any:
        def start(mode: str) -> Any:
            return self.wandb.init(
                project=self.project,
                group=self.group,
                dir=str(self.out_dir),
                mode=mode,
                reinit="create_new",
                settings=self.wandb.Settings(**self.settings),
                **kwargs,
            )

        if self.mode == "online":
            try:
                return start("online")
            except Exception as err:  # CommError, UsageError, timeouts: never hold the ablation up
                warnings.warn(
                    f"wandb online failed ({err}); logging offline under {self.out_dir}", stacklevel=2
                )
                self.mode = "offline"
        return start(self.mode)

    def arm(self, run: ArmRun, row: dict[str, Any]) -> None:
        if self.mode == "disabled":
            return
        config = {
            **run.config.model_dump(mode="json"),
            "arm": run.arm,
            "parent": run.parent,
            "change": _change(run),
            "grid_point": run.grid_point,
        }
        wb = self._init(name=run.key, job_type="arm", config=config)
        wb.summary.update({k: v for k, v in _jsonable(row).items() if v is not None and k != "notes"})
        wb.finish()
        self.num_runs += 1

    def summary(self, rows: list[dict[str, Any]], plots: list[Path], info: dict[str, Any]) -> None:
        if self.mode == "disabled":
            return
        wb = self._init(name=f"{self.group}/summary", job_type="summary", config=info)
        columns = list(rows[0])
        data = [[None if isinstance(v, float) and math.isnan(v) else v for v in row.values()] for row in rows]
        wb.log(
            {
                "results": self.wandb.Table(columns=columns, data=data, allow_mixed_types=True),
                **{f"plots/{path.stem}": self.wandb.Image(str(path)) for path in plots},
            }
        )
        wb.finish()
        self.num_runs += 1

    def close(self) -> None:
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def sync_hint(self) -> str | None:
        if self.mode != "offline" or not self.num_runs:
            return None
        return (
            f"wandb sync {self.out_dir / 'wandb'}/offline-run-*   # upload the {self.num_runs} offline runs"
        )


# ---------------------------------------------------------------- the command


@dataclass(frozen=True)
class AblationResult:
    rows: list[dict[str, Any]]
    plots: list[Path]
    info: dict[str, Any]

    @property
    def num_failed(self) -> int:
        return sum(row["status"] == "failed" for row in self.rows)


def _git_rev() -> str:
    """The checkout's commit (+ '-dirty' with uncommitted changes to tracked files); read only."""
    repo = Path(__file__).resolve().parents[1]
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=5, check=True
            ).stdout.strip()

        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _validate_workloads(plan: AblationPlan) -> None:
    """Bad traces and empty slices fail here, before any arm runs (one build per distinct
    workload: lengths, prompts and arrivals only, no model)."""
    from preempt.workload import build_workload

    seen = set()
    for run in plan.runs:
        key = (run.config.workload.model_dump_json(), run.config.seed)
        if key not in seen:
            seen.add(key)
            build_workload(run.config.workload, seed=run.config.seed)


def _info(plan: AblationPlan, jobs: int, overrides: list[str]) -> dict[str, Any]:
    """DIR/ablation.json: what ran, with which configs, from which commit."""
    return {
        "name": plan.config.name,
        "description": plan.config.description,
        "source": plan.source,
        "git_rev": _git_rev(),
        "jobs": jobs,
        "predictor": plan.predictor,
        "quality_reference": plan.config.quality_reference,
        "grid": plan.config.grid,
        "overrides": overrides,
        "runs": [
            {
                "run": run.key,
                "arm": run.arm,
                "parent": run.parent,
                "reference": run.reference,
                "grid_point": run.grid_point,
                "set": run.own_set,
                "doc": run.doc,
                "skip_reason": run.skip_reason,
                "config": run.config.model_dump(mode="json"),
            }
            for run in plan.runs
        ],
    }


def ablate(
    config_path: str | Path,
    out_dir: str | Path,
    *,
    wandb: str | None = None,
    jobs: int | None = None,
    predictor: str | None = None,
    overrides: list[str] = (),
    only: list[str] | None = None,
    resume: bool = False,
    plots: bool = True,
    log: Callable[[str], None] = print,
) -> AblationResult:
    """Plan (validates everything), run the arms, write the table, plots and wandb runs."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    plan = plan_ablation(config_path, out_dir, overrides=list(overrides), predictor=predictor, only=only)
    mode = resolve_wandb_mode(wandb)
    _validate_workloads(plan)
    jobs = jobs or default_jobs(sum(run.skip_reason is None for run in plan.runs))
    out_dir.mkdir(parents=True, exist_ok=True)
    for run in plan.runs:
        if run.skip_reason:
            log(f"skip {run.key}: {run.skip_reason}")

    num_runs, num_done = len(plan.runs), [0]

    def on_done(run: ArmRun, outcome: dict[str, Any]) -> None:
        num_done[0] += 1
        metrics, status = outcome.get("metrics", {}), outcome["status"]
        detail = (
            f"goodput {metrics['goodput_req_s']:.3g} req/s, {metrics['num_preemptions']} preemptions, "
            f"stall {metrics['preemption_stall_s']:.3g} s, {metrics['wall_time_s']:.1f} s wall"
            if status == "ok"
            else outcome.get("error", "")
        )
        log(f"[{num_done[0]}/{num_runs}] {run.key}: {status}: {detail}")
        if status == "failed" and outcome.get("trace"):
            print(outcome["trace"], file=sys.stderr)

    log(f"ablation {plan.config.name}: {num_runs} runs, {jobs} jobs, wandb {mode}, out {out_dir}")
    outcomes = execute(plan, out_dir, jobs, resume=resume, on_done=on_done)
    rows = results_rows(plan, out_dir, outcomes)
    write_csv(rows, out_dir / "results.csv")
    plot_paths: list[Path] = []
    if plots:
        from experiments.plots import plot_ablation

        plot_paths = plot_ablation(rows, out_dir, [(run.key, run.grid_point) for run in plan.runs])
    info = _info(plan, jobs, list(overrides))
    info["wall_s"] = time.perf_counter() - started
    (out_dir / "results.md").write_text(results_markdown(info, rows))

    group = f"{plan.config.name}:{out_dir.resolve().name}"
    sink = _WandbSink(mode, out_dir, plan.config.wandb_project, group)
    try:
        for run, row in zip(plan.runs, rows, strict=True):
            if row["status"] == "ok":
                sink.arm(run, row)
        sink.summary(rows, plot_paths, {k: v for k, v in info.items() if k != "runs"})
    finally:
        sink.close()
    info["wandb"], info["wandb_sync"] = sink.mode, sink.sync_hint()
    (out_dir / "ablation.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    return AblationResult(rows, plot_paths, info)
