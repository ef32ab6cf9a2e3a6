"""Running an ablation or a sweep: `preempt ablate --config preempt/configs/NAME.yaml --out DIR`.

Owns: the command: plan (experiments.plan), execute (experiments.execution: in process or
as Ray tasks, `--ray-address` for a cluster), the results rows (metrics from
experiments.measure, output quality from experiments.quality), with seeds the points with
95% intervals (experiments.aggregate -> `DIR/summary.csv`), the tables
(experiments.tables), plots (experiments.plots), `DIR/ablation.json` (what ran, with which
configs, at which commit) and the wandb runs (experiments.wandb_sink: one group per
ablation, one run per arm and point, plus a summary run).

Must never: block on the network, import pytorch_lightning, or change an arm's config
after planning (runs are reproducible: same config + seed => same metrics on the virtual
clock; only `wall_time_s` varies).

Layout of DIR:
    ablation.json, results.csv, summary.csv (with seeds), results.md, plots/*.png, wandb/
    arms/<run>/requests.parquet, summary.json, preemptions.parquet, metrics.json
    inputs/ (derived targets and traces of `derive.*` grid keys)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.aggregate import aggregate, point_key
from experiments.catalogue import LOSSY_MODES, METRICS, NAN
from experiments.execution import default_jobs, execute
from experiments.plan import AblationPlan, ArmRun, plan_ablation, without_seed
from experiments.quality import score_quality
from experiments.tables import note_no_effect, results_markdown, write_csv
from experiments.wandb_sink import WandbSink
from preempt.obs.tracking import resolve_wandb_mode


def change_text(run: ArmRun) -> str:
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
            "change": change_text(run),
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
            row["quality_note"] = score_quality(plan, run, out_dir, outcomes, reference, row)
            if cfg.preemption.mode not in LOSSY_MODES and row["token_agreement"] < 1.0:
                notes.append("outputs differ from the reference although this arm's mode is lossless")
        row["notes"] = notes
        rows.append(row)
    note_no_effect(rows)
    for row in rows:
        row["notes"] = " | ".join(row["notes"])
    return rows


@dataclass(frozen=True)
class AblationResult:
    rows: list[dict[str, Any]]
    plots: list[Path]
    info: dict[str, Any]
    points: list[dict[str, Any]] | None = None  # with seeds: summary.csv's rows

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
    from preempt.core.workload import build_workload

    seen = set()
    for run in plan.runs:
        key = (run.config.workload.model_dump_json(), run.config.seed)
        if key not in seen:
            seen.add(key)
            build_workload(run.config.workload, seed=run.config.seed)


def _info(plan: AblationPlan, jobs: int, overrides: list[str], git_rev: str) -> dict[str, Any]:
    """DIR/ablation.json: what ran, with which configs, from which commit (`git_rev`, read
    when the runs started: edits made while they run are not what ran)."""
    return {
        "name": plan.config.name,
        "description": plan.config.description,
        "source": plan.source,
        "git_rev": git_rev,
        "jobs": jobs,
        "predictor": plan.predictor,
        "quality_reference": plan.config.quality_reference,
        "grid": plan.config.grid,
        "seeds": plan.config.seeds,
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
    ray_address: str | None = None,
    log: Callable[[str], None] = print,
) -> AblationResult:
    """Plan (validates everything), run the arms (Ray tasks unless one job), write the
    tables, plots and wandb runs."""
    started = time.perf_counter()
    git_rev = _git_rev()
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

    where = f"Ray at {ray_address}" if ray_address else ("in process" if jobs <= 1 else f"Ray, {jobs} CPUs")
    log(f"ablation {plan.config.name}: {num_runs} runs, {where}, wandb {mode}, out {out_dir}")
    outcomes = execute(plan, out_dir, jobs, resume=resume, on_done=on_done, ray_address=ray_address)
    rows = results_rows(plan, out_dir, outcomes)
    write_csv(rows, out_dir / "results.csv")
    seeds = plan.config.seeds
    points = aggregate(plan, rows, out_dir) if seeds else None
    if points is not None:
        write_csv(points, out_dir / "summary.csv")
    plot_paths: list[Path] = []
    if plots:
        from experiments.plots import plot_ablation, plot_sweep

        status = {row["run"]: row["status"] for row in rows}
        ran = [
            (
                point_key(run.arm, run.grid_point),
                without_seed(run.grid_point),
                run.grid_point.get("seed"),
                run.key,
            )
            for run in plan.runs
            if status[run.key] == "ok"
        ]
        plot_paths = plot_ablation(points if points is not None else rows, out_dir, ran)
        if points is not None:
            plot_paths += plot_sweep(points, plan.config.grid, out_dir / "plots")
    info = _info(plan, jobs, list(overrides), git_rev)
    info["ray_address"] = ray_address
    info["wall_s"] = time.perf_counter() - started
    (out_dir / "results.md").write_text(results_markdown(info, rows, points))

    group = f"{plan.config.name}:{out_dir.resolve().name}"
    sink = WandbSink(mode, out_dir, plan.config.wandb_project, group)
    try:
        by_run = {row["run"]: row for row in rows}
        if points is None:
            for run in plan.runs:
                if by_run[run.key]["status"] == "ok":
                    sink.point(run.key, _wandb_config(run), by_run[run.key])
        else:
            runs_of: dict[str, list[ArmRun]] = {}
            for run in plan.runs:
                runs_of.setdefault(point_key(run.arm, run.grid_point), []).append(run)
            for point in points:
                runs = runs_of[point["run"]]
                steps = [by_run[r.key] for r in runs if by_run[r.key]["status"] == "ok"]
                if steps:
                    config = {**_wandb_config(runs[0]), "seeds": [r.grid_point["seed"] for r in runs]}
                    sink.point(point["run"], config, point, steps)
        sink.summary(points or rows, plot_paths, {k: v for k, v in info.items() if k != "runs"})
    finally:
        sink.close()
    info["wandb"], info["wandb_sync"] = sink.mode, sink.sync_hint()
    (out_dir / "ablation.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    return AblationResult(rows, plot_paths, info, points)


def _wandb_config(run: ArmRun) -> dict[str, Any]:
    return {
        **run.config.model_dump(mode="json"),
        "arm": run.arm,
        "parent": run.parent,
        "change": change_text(run),
        "grid_point": without_seed(run.grid_point),
    }
