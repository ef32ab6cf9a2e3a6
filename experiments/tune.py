"""Tuning an arm's knobs: `preempt tune --config preempt/configs/tune.yaml --out DIR`.

Owns: the Optuna study (TPE, seeded, the
parent arm's own values enqueued as trial 0, ask/tell in batches), each trial as a
one-arm ablation (the parent + the trial's values) on the training points, run by
experiments.execution (in process, or Ray tasks on this machine or at `--ray-address`),
the objective and constraint read from the runs' metrics, and DIR's files.

Must never: tune on a window of the trace that a held-out judge replays (`held_out:`,
load.yaml by default: checked before anything runs), feed the sampler anything that is
not reproducible (wall times are recorded, never scored), or block on the network
(experiments.wandb_sink). Same config + sampler seed => same trials, params and
objectives (the runs are deterministic on the virtual clock, and trials are told in
their number order, not in the order they finish).

The tune config and its checks are experiments.tune_config's.

Layout of DIR:
    study.json (every trial: params, objective, constraint, per-run metrics; the cost),
    best.yaml (the best trial as an arm for an ablation config's `arms:`), wandb/
    trials/<NNN>/ablation.yaml (the trial as an ablation config: `preempt ablate` reruns it)
    trials/<NNN>/arms/<run>/ (experiments.execution's run files)
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.execution import RayRunner, default_jobs, execute
from experiments.plan import AblationPlan, ArmRun, ArmSpec, plan_ablation
from experiments.tune_config import TunePlan, ablation_data, plan_tune, trial_overrides, write_yaml
from experiments.wandb_sink import WandbSink, jsonable
from preempt.core.config import ConfigError
from preempt.obs.tracking import resolve_wandb_mode

# ---------------------------------------------------------------- the study


@dataclass
class TuneResult:
    summary: dict[str, Any]  # the CLI's JSON line
    trials: list[dict[str, Any]]
    best: dict[str, Any] | None


def _score(plan: TunePlan, runs: list[ArmRun], outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A trial's objective and constraint: means over its runs; failed if a run failed
    or a metric is undefined in one."""
    row: dict[str, Any] = {"runs": {}, "wall_s": 0.0}
    errors = []
    for run in runs:
        outcome = outcomes[run.key]
        metrics = outcome.get("metrics", {})
        row["runs"][run.key] = {
            "grid_point": run.grid_point,
            "status": outcome["status"],
            **({"error": outcome["error"]} if outcome.get("error") else {}),
            "metrics": jsonable(metrics),
        }
        row["wall_s"] += metrics.get("wall_time_s", 0.0)
        if outcome["status"] != "ok":
            errors.append(f"{run.key}: {outcome['status']}: {outcome.get('error', '')}")
    means = {}
    for name in filter(None, (plan.objective, plan.constraint)):
        values = [row["runs"][run.key]["metrics"].get(name) for run in runs]
        if not errors and any(v is None for v in values):
            errors.append(f"{name} undefined in {runs[values.index(None)].key}")
        means[name] = None if errors else sum(values) / len(values)
    row["objective"] = means[plan.objective]
    row["constraint"] = means.get(plan.constraint) if plan.constraint else None
    row["constraint_violation"] = (
        None if row["constraint"] is None else row["constraint"] - plan.at_most if plan.constraint else 0.0
    )
    row["feasible"] = None if errors else row["constraint_violation"] <= 0
    row["state"] = "failed" if errors else "complete"
    if errors:
        row["error"] = "; ".join(errors)
    return row


def _best(rows: list[dict[str, Any]], direction: str) -> dict[str, Any] | None:
    """The best feasible trial; without one, the least infeasible (then the best value)."""
    done = [row for row in rows if row["state"] == "complete"]
    sign = 1.0 if direction == "maximize" else -1.0
    feasible = [row for row in done if row["feasible"]]
    if feasible:
        return max(feasible, key=lambda r: (sign * r["objective"], -r["number"]))
    if done:
        return min(done, key=lambda r: (r["constraint_violation"], -sign * r["objective"], r["number"]))
    return None


class _StudySink(WandbSink):
    """One wandb run for the study (`job_type=tune`): a logged step per trial (its values,
    params and the best so far), a table of every trial and the best in the summary."""

    run: Any = None

    def start(self, name: str, config: dict[str, Any]) -> None:
        if self.mode != "disabled":
            self.run = self._init(name=name, job_type="tune", config=config)

    def trial(self, row: dict[str, Any], best: dict[str, Any] | None) -> None:
        if self.run is None:
            return
        step = {
            "trial": row["number"],
            "feasible": int(bool(row["feasible"])),
            "failed": int(row["state"] == "failed"),
            **{f"param/{k}": v if isinstance(v, int | float) and not isinstance(v, bool) else str(v)
               for k, v in row["params"].items()},
        }  # fmt: skip
        for key in ("objective", "constraint", "wall_s"):
            if row[key] is not None:
                step[key] = row[key]
        if best is not None:
            step["best_objective"] = best["objective"]
        self.run.log(step, step=row["number"])

    def finish(self, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        params = list(rows[0]["params"]) if rows else []
        columns = ["trial", "state", "objective", "constraint", "feasible", "wall_s", *params]
        data = [
            [r["number"], r["state"], r["objective"], r["constraint"], r["feasible"], r["wall_s"]]
            + [str(r["params"][k]) for k in params]
            for r in rows
        ]
        self.run.log({"trials": self.wandb.Table(columns=columns, data=data, allow_mixed_types=True)})
        flat = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
        flat.update({f"best/{k}": v for k, v in (summary.get("best") or {}).items() if k != "params"})
        self.run.summary.update(flat)
        self.run.finish()
        self.run = None
        self.num_runs += 1


def _run_batch(
    plans: dict[int, AblationPlan], out: Path, jobs: int, ray_address: str | None, resume: bool
) -> dict[int, dict[str, dict[str, Any]]]:
    """Every run of the batch's trials at once: one `execute` per trial, side by side in
    threads on the Ray already started (one job without an address: one after another,
    in this process)."""
    folder = {n: out / "trials" / f"{n:03d}" for n in plans}
    if jobs <= 1 and ray_address is None:
        return {n: execute(plan, folder[n], 1, resume=resume) for n, plan in plans.items()}
    with ThreadPoolExecutor(max_workers=len(plans)) as pool:
        futures = {
            n: pool.submit(execute, plan, folder[n], jobs, resume=resume, ray_address=ray_address)
            for n, plan in plans.items()
        }
        return {n: future.result() for n, future in futures.items()}


def _arm_doc(plan: TunePlan, best: dict[str, Any], default: dict[str, Any] | None, command: str) -> str:
    tune, n_runs = plan.config, len(plan.parent_runs)
    doc = (
        f"`{command}`: trial {best['number']} of the study (TPE, sampler seed {tune.sampler_seed}), "
        f"{tune.objective.direction[:-1]}ing the mean {plan.objective} over {n_runs} training runs"
    )
    if plan.constraint:
        doc += f" with mean {plan.constraint} <= {plan.at_most:g}"
    doc += f": {best['objective']:.4g}"
    if plan.constraint:
        doc += f", {plan.constraint} {best['constraint']:.3g}"
    if default is not None and default["state"] == "complete":
        doc += f" (the parent {tune.parent}'s own values, trial 0: {default['objective']:.4g}"
        doc += f", {default['constraint']:.3g})" if plan.constraint else ")"
    if not best["feasible"]:
        doc += "; INFEASIBLE: no trial met the constraint, this one missed it by the least"
    return doc


def tune(
    config_path: str | Path,
    out_dir: str | Path,
    *,
    trials: int | None = None,
    jobs: int | None = None,
    ray_address: str | None = None,
    wandb: str | None = None,
    resume: bool = False,
    command: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> TuneResult:
    """Plan (validates everything), run the study in batches, write study.json, best.yaml
    and the wandb run; returns the summary the CLI prints."""
    import optuna

    started = time.perf_counter()
    plan = plan_tune(config_path)
    cfg, out = plan.config, Path(out_dir)
    mode = resolve_wandb_mode(wandb)
    total = trials or cfg.trials
    command = command or f"preempt tune --config {config_path} --out {out_dir}"
    jobs = jobs or default_jobs(len(plan.parent_runs) * min(cfg.batch, total))
    out.mkdir(parents=True, exist_ok=True)
    where = f"Ray at {ray_address}" if ray_address else ("in process" if jobs <= 1 else f"Ray, {jobs} CPUs")
    log(
        f"tune {cfg.name}: {total} trials of {len(plan.parent_runs)} runs, batches of {cfg.batch}, "
        f"{where}, wandb {mode}, out {out}"
    )
    info = {
        "name": cfg.name,
        "source": plan.source,
        "command": command,
        "parent": cfg.parent,
        "objective": {"metric": plan.objective, "direction": cfg.objective.direction},
        "constraint": {"metric": plan.constraint, "at_most": plan.at_most} if plan.constraint else None,
        "sampler": {"name": "TPESampler", "seed": cfg.sampler_seed, "n_startup_trials": cfg.startup_trials},
        "optuna": optuna.__version__,
        "jobs": jobs,
        "ray_address": ray_address,
        "training_runs": [{"run": r.key, "grid_point": r.grid_point} for r in plan.parent_runs],
        "windows": [{**w, "end_s": None if math.isinf(w["end_s"]) else w["end_s"]} for w in plan.windows],
        "config": cfg.model_dump(mode="json"),
    }
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own line per trial instead
    sink = _StudySink(mode, out, cfg.wandb_project, f"{cfg.name}:{out.resolve().name}")
    try:
        sink.start(sink.group, {k: info[k] for k in ("config", "objective", "constraint", "sampler")})
        rows = _study(plan, out, total, jobs, ray_address, resume, command, info, started, sink, log)
        best = _best(rows, cfg.objective.direction)
        keys = ("number", "params", "objective", "constraint", "feasible")
        summary = {
            "name": cfg.name,
            "best": None if best is None else {k: best[k] for k in keys},
            "default": {k: rows[0][k] for k in keys},
            "trials": len(rows),
            "failed": sum(row["state"] == "failed" for row in rows),
            "feasible": sum(bool(row["feasible"]) for row in rows),
            **_write_study(out, info, rows, started)["cost"],
            "out": str(out),
        }
        if best is not None:
            _write_best(out / "best.yaml", plan, best, rows[0], command)
            summary["best_yaml"] = str(out / "best.yaml")
        sink.finish(rows, summary)
    finally:
        if sink.run is not None:  # the study broke off: its wandb run ends as failed
            sink.run.finish(exit_code=1)
        sink.close()
        optuna.logging.set_verbosity(verbosity)
    summary["wandb"], summary["wandb_sync"] = sink.mode, sink.sync_hint()
    return TuneResult(summary, rows, best)


def _study(
    plan: TunePlan,
    out: Path,
    total: int,
    jobs: int,
    ray_address: str | None,
    resume: bool,
    command: str,
    info: dict[str, Any],
    started: float,
    sink: _StudySink,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The ask/tell loop: a batch of trials asked, written as ablation configs, run
    together, then told in their number order (deterministic). Returns study.json's rows."""
    import optuna

    cfg = plan.config
    sampler = optuna.samplers.TPESampler(seed=cfg.sampler_seed, n_startup_trials=cfg.startup_trials)
    study = optuna.create_study(study_name=cfg.name, direction=cfg.objective.direction, sampler=sampler)
    study.enqueue_trial(plan.default, user_attrs={"default": True})
    rows: list[dict[str, Any]] = []
    runner = RayRunner(jobs, ray_address) if jobs > 1 or ray_address else None  # once, for every batch
    try:
        while len(rows) < total:
            asked = [study.ask(plan.distributions) for _ in range(min(cfg.batch, total - len(rows)))]
            plans, pending = {}, {}
            for trial in asked:
                params = dict(trial.params)
                arm_set = trial_overrides(cfg, params)
                file = out / "trials" / f"{trial.number:03d}" / "ablation.yaml"
                doc = f"trial {trial.number} of `{command}`"
                header = f"# {doc}; rerun: preempt ablate --config {file} --out DIR\n"
                write_yaml(file, ablation_data(cfg, plan.base_config, arm_set, doc), header)
                pending[trial.number] = (trial, params, arm_set, None)
                try:
                    plans[trial.number] = plan_ablation(file, file.parent)
                except ConfigError as err:  # valid values whose combination is not
                    pending[trial.number] = (trial, params, arm_set, str(err))
            outcomes = _run_batch(plans, out, jobs, ray_address, resume)
            for number in sorted(pending):
                trial, params, arm_set, error = pending[number]
                if error is None:
                    row = _score(plan, plans[number].runs, outcomes[number])
                else:
                    row = {"runs": {}, "wall_s": 0.0, "objective": None, "constraint": None}
                    row.update(constraint_violation=None, feasible=None, state="failed", error=error)
                row = {"number": number, "default": number == 0, "params": params, "set": arm_set, **row}
                if row["state"] == "complete":
                    trial.set_user_attr("constraint", row["constraint"])
                    if plan.constraint:
                        trial.set_constraint(plan.constraint, row["constraint_violation"])
                    study.tell(trial, row["objective"])
                else:
                    trial.set_user_attr("error", row["error"])
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                rows.append(row)
                sink.trial(row, _best(rows, cfg.objective.direction))
                log(_trial_line(plan, row, total))
            _write_study(out, info, rows, started)
    finally:
        if runner is not None:
            runner.close()
    return rows


def _write_best(path: Path, plan: TunePlan, best: dict, default: dict, command: str) -> None:
    doc = _arm_doc(plan, best, default, command)
    spec = ArmSpec(name=plan.config.name, parent=plan.config.parent, set=best["set"], doc=doc)
    header = "# The best trial of the study (study.json), an arm for an ablation config's `arms:`\n"
    header += "# (paste it as one list item; `preempt ablate` then runs it beside its parent).\n"
    if not best["feasible"]:
        header += f"# INFEASIBLE: no trial met {plan.constraint} <= {plan.at_most:g}; the nearest.\n"
    write_yaml(path, spec.model_dump(exclude={"reference"}), header)


def _trial_line(plan: TunePlan, row: dict[str, Any], total: int) -> str:
    head = f"[trial {row['number']}/{total}]"
    if row["state"] == "failed":
        return f"{head} failed: {row['error']}"
    line = f"{head} {plan.objective} {row['objective']:.4g}"
    if plan.constraint:
        verdict = "ok" if row["feasible"] else "infeasible"
        line += f", {plan.constraint} {row['constraint']:.3g} ({verdict} at <= {plan.at_most:g})"
    params = ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in row["params"].items())
    return f"{line}, {row['wall_s']:.0f} s of runs: {params}"


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _write_study(out: Path, info: dict[str, Any], rows: list[dict[str, Any]], started: float) -> dict:
    """DIR/study.json (rewritten after every batch). Cost: the runs' own wall seconds (one
    core each) as CPU-hours; the tune's wall time, and on this machine the CPU-hours of the
    cores it held (wall time x jobs: what the runs cost plus Ray's and the sampler's)."""
    run_s = sum(row["wall_s"] for row in rows)
    wall_s = time.perf_counter() - started
    cost = {
        "runs": sum(len(row["runs"]) for row in rows),
        "run_s": round(run_s, 3),
        "cpu_hours": round(run_s / 3600, 4),
        "wall_s": round(wall_s, 3),
        "held_cpu_hours": None if info["ray_address"] else round(wall_s * info["jobs"] / 3600, 4),
    }
    best = _best(rows, info["objective"]["direction"])
    study = {**info, "cost": cost, "best": None if best is None else best["number"], "trials": rows}
    (out / "study.json").write_text(json.dumps(study, indent=1, default=str) + "\n")
    return study
