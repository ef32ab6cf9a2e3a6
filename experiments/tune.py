"""Tuning an arm's knobs: `preempt tune --config experiments/configs/tune.yaml --out DIR`.

Owns: the tune config (pydantic, frozen, unknown keys rejected; every error one
`ConfigError` naming the key, before anything runs), the Optuna study (TPE, seeded, the
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

Over 500 lines because the tune config is its own reference (every field documented, as
experiments/arms.py's) beside the study it runs.

Layout of DIR:
    study.json (every trial: params, objective, constraint, per-run metrics; the cost),
    best.yaml (the best trial as an arm for an ablation config's `arms:`), wandb/
    trials/<NNN>/ablation.yaml (the trial as an ablation config: `preempt ablate` reruns it)
    trials/<NNN>/arms/<run>/ (experiments.execution's run files)
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from experiments.arms import AblationPlan, ArmRun, ArmSpec, plan_ablation
from experiments.catalogue import METRICS, NOT_REPRODUCIBLE, SLA_METRICS
from experiments.execution import RayRunner, default_jobs, execute
from experiments.wandb_sink import WandbSink, jsonable
from preempt.core.config import ConfigError, build_config, format_validation_error, set_dotted
from preempt.obs.tracking import resolve_wandb_mode

CONFIGS = Path(__file__).resolve().parent / "configs"

# ---------------------------------------------------------------- the config file


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RangeSpec(_Frozen):
    """A number between `low` and `high` (both included)."""

    low: float
    high: float
    log: bool = False
    """Sample on a log scale (low > 0, no step)."""
    step: float | None = Field(None, gt=0)
    type: Literal["float", "int"] = "float"


class ChoiceSpec(_Frozen):
    """One of `choices` (null, booleans, numbers, strings; YAML null for e.g. "no cap")."""

    choices: list[Any] = Field(min_length=1)


class Constraint(_Frozen):
    metric: str = "sla{top}_ttft_p99_s"
    """A metric of experiments.catalogue; `{top}` is the workload's highest SLA level."""
    at_most_s: float
    """Feasible when the mean of `metric` over the training runs is at most this."""


class Objective(_Frozen):
    metric: str = "goodput_req_s"
    """Its mean over the training runs is the trial's value."""
    direction: Literal["maximize", "minimize"] = "maximize"
    constraint: Constraint | None = None


class SetWhen(_Frozen):
    """Overrides a trial gets when its values match `when` (e.g. pause -> async restores)."""

    when: dict[str, Any] = Field(min_length=1)
    set: dict[str, Any] = Field(min_length=1)


class TuneConfig(_Frozen):
    """One search: the arm it starts from, the knobs and their ranges, the training
    points, the objective, and the study's size."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """The tuned arm's name (best.yaml), the study's and the wandb group's."""
    description: str = ""
    base_config: str | None = None
    """An engine config file, looked up as an ablation config's (beside this file, then
    among the bundled configs)."""
    base: dict[str, Any] = Field(default_factory=dict)
    parent: str
    """The arm every trial modifies (a standard arm, experiments.arms.STANDARD_ARMS)."""
    space: dict[str, Any] = Field(min_length=1)
    """Dotted engine-config key -> {low, high, log, step, type} or {choices: [...]}."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Overrides every trial gets (trial 0 too: it is then the parent + these)."""
    set_when: list[SetWhen] = Field(default_factory=list)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    seeds: list[int] | None = Field(None, min_length=1)
    replicate: dict[str, list[Any]] = Field(default_factory=dict)
    """The training points: as an ablation config's grid, seeds and replicate."""
    held_out: list[str] = Field(default_factory=lambda: ["load.yaml"])
    """Ablation configs whose trace windows no training run may overlap (their judges)."""
    objective: Objective = Objective()
    trials: int = Field(48, ge=1)
    batch: int = Field(4, ge=1)
    """Trials asked at once; their runs execute together."""
    sampler_seed: int = 0
    startup_trials: int = Field(10, ge=0)
    """TPE's random trials (the enqueued default among them) before it models the results."""
    wandb_project: str = "preempt-tune"


def _find_config(name: str, beside: Path) -> Path:
    """As an ablation's `base_config`: relative paths beside `beside`, then bundled."""
    path = Path(name)
    if path.is_absolute():
        return path
    near, bundled = beside.parent / path, CONFIGS / path
    return near if near.exists() or not bundled.exists() else bundled


def _spec(raw: Any) -> RangeSpec | ChoiceSpec:
    if not isinstance(raw, dict):
        raise ConfigError("expected {low, high[, log, step, type]} or {choices: [...]}")
    try:
        return (ChoiceSpec if "choices" in raw else RangeSpec).model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "key")) from None


def _distribution(spec: RangeSpec | ChoiceSpec) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(spec, ChoiceSpec):
        bad = [c for c in spec.choices if c is not None and not isinstance(c, bool | int | float | str)]
        if bad:
            raise ConfigError(f"choice {bad[0]!r}: choices are null, booleans, numbers or strings")
        if len({repr(c) for c in spec.choices}) != len(spec.choices):
            raise ConfigError("a choice is listed twice")
        return CategoricalDistribution(spec.choices)
    if spec.low > spec.high:
        raise ConfigError(f"low ({spec.low:g}) is above high ({spec.high:g})")
    if spec.log and (spec.low <= 0 or spec.step is not None):
        raise ConfigError("log needs low > 0 and no step")
    if spec.type == "int":
        values = (spec.low, spec.high, spec.step or 1)
        if any(v != int(v) for v in values):
            raise ConfigError("type int needs whole low, high and step")
        return IntDistribution(int(spec.low), int(spec.high), log=spec.log, step=int(spec.step or 1))
    return FloatDistribution(spec.low, spec.high, log=spec.log, step=spec.step)


def _get_dotted(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"unknown config key '{key}'")
        node = node[part]
    return node


def _known_metric(name: str) -> bool:
    match = re.fullmatch(r"sla\d+_(.+)", name)
    return (name in METRICS or (match is not None and match.group(1) in SLA_METRICS)) and (
        name not in NOT_REPRODUCIBLE
    )


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class TunePlan:
    """A validated search: the config and what it resolves to."""

    config: TuneConfig
    source: str
    base_config: str | None  # absolute: trial configs name it
    distributions: dict[str, Any]  # dotted key -> optuna distribution
    default: dict[str, Any]  # the parent's own values of the space (trial 0)
    parent_runs: list[ArmRun]  # the parent at every training point
    objective: str
    constraint: str | None
    at_most: float | None
    windows: list[dict[str, Any]]  # the training windows, and the held-out ones they avoid


def _ablation_data(tune: TuneConfig, base_config: str | None, arm_set: dict[str, Any], doc: str) -> dict:
    data: dict[str, Any] = {"name": tune.name, "description": doc}
    if base_config is not None:
        data["base_config"] = base_config
    data.update(base=tune.base, grid=tune.grid, replicate=tune.replicate, wandb_project=tune.wandb_project)
    if tune.seeds is not None:
        data["seeds"] = tune.seeds
    data["arms"] = [{"name": tune.name, "parent": tune.parent, "set": arm_set, "doc": doc}]
    return data


def _write_yaml(path: Path, data: dict[str, Any], header: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=100))


def _windows(runs: list[ArmRun]) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        w = run.config.workload
        end = math.inf if w.duration_s is None else w.start_s + w.duration_s  # to the trace's end
        window = {"trace": w.trace, "start_s": w.start_s, "end_s": end, "run": run.key}
        if not any((o["trace"], o["start_s"], o["end_s"]) == (w.trace, w.start_s, end) for o in out):
            out.append(window)
    return out


def _check_held_out(tune: TuneConfig, path: Path, training: list[dict[str, Any]]) -> list[dict]:
    where = "replicate 'workload.start_s'" if "workload.start_s" in tune.replicate else "workload.start_s"
    judged = []
    for name in tune.held_out:
        with tempfile.TemporaryDirectory() as scratch:  # derived inputs, if any, are thrown away
            runs = plan_ablation(_find_config(name, path), scratch).runs
        for held in _windows(runs):
            judged.append({**held, "config": name})
            for train in training:
                if (
                    train["trace"] == held["trace"]
                    and train["start_s"] < held["end_s"]
                    and (held["start_s"] < train["end_s"])
                ):
                    raise ConfigError(
                        f"{path}: {where}: training window [{train['start_s']:g}, {train['end_s']:g}) s "
                        f"of {train['trace']} ({train['run']}) overlaps [{held['start_s']:g}, "
                        f"{held['end_s']:g}) s, which held-out {name} replays ({held['run']}): the "
                        "tune would train on its judge's data"
                    )
    return judged


def _overrides(tune: TuneConfig, params: dict[str, Any]) -> dict[str, Any]:
    """A trial's overrides of the parent: the fixed `set`, its values, then `set_when`."""
    values = {**tune.set, **params}
    for rule in tune.set_when:
        if all(k in values and _same(values[k], v) for k, v in rule.when.items()):
            values.update(rule.set)
    return values


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # true is not 1


def load_tune_config(path: str | Path) -> TuneConfig:
    from preempt.core.config import read_config_file

    try:
        return TuneConfig.model_validate(read_config_file(path))
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, 'key')}") from None


def plan_tune(path: str | Path) -> TunePlan:
    """Validate the tune config at `path` (space, objective, training points, held-out
    windows) and resolve the parent at every training point. Raises ConfigError naming
    the key. Writes nothing."""
    path = Path(path)
    tune = load_tune_config(path)
    if tune.name == tune.parent:
        raise ConfigError(f"{path}: name '{tune.name}': must differ from parent (it names the tuned arm)")
    base_config = str(_find_config(tune.base_config, path).resolve()) if tune.base_config else None
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "parent.yaml"
        _write_yaml(file, _ablation_data(tune, base_config, {}, "the parent"))
        try:
            runs = plan_ablation(file, scratch).runs
        except ConfigError as err:
            raise ConfigError(str(err).replace(str(file), str(path))) from None
    data = runs[0].config.model_dump(mode="json")

    distributions, default = {}, {}
    fixed = {*tune.grid, *tune.replicate, *tune.set}
    for key, raw in tune.space.items():
        where = f"{path}: space '{key}'"
        if key == "seed" or key.startswith(("workload.", "derive.")):
            raise ConfigError(f"{where}: the workload is the training data, not a knob")
        if key in fixed:
            raise ConfigError(f"{where}: also set by grid, replicate or set")
        try:
            spec = _spec(raw)
            distribution = _distribution(spec)
            default[key] = _get_dotted(runs[0].config.model_dump(), key)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        candidates = spec.choices if isinstance(spec, ChoiceSpec) else [spec.low, spec.high]
        for value in candidates:
            trial = copy.deepcopy(data)
            set_dotted(trial, key, int(value) if getattr(spec, "type", "") == "int" else value)
            try:
                build_config(trial)
            except ConfigError as err:
                raise ConfigError(f"{where}: {value!r}: {err}") from None
        if not distribution._contains(distribution.to_internal_repr(default[key])):
            raise ConfigError(
                f"{where}: the parent '{tune.parent}' has {default[key]!r}, outside the space (trial 0 "
                "is the parent's own values, so the default is always in the study)"
            )
        distributions[key] = distribution
    for i, rule in enumerate(tune.set_when):
        where = f"{path}: set_when[{i}]"
        if unknown := [k for k in rule.when if k not in distributions and k not in tune.set]:
            raise ConfigError(f"{where}: when '{unknown[0]}': not a key of space or set")
        if clash := [k for k in rule.set if k in distributions]:
            raise ConfigError(f"{where}: set '{clash[0]}': a key of space (the sampler owns it)")
        trial = copy.deepcopy(data)
        for key, value in {**tune.set, **rule.when, **rule.set}.items():
            set_dotted(trial, key, value)
        try:
            build_config(trial)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None

    mix = runs[0].config.workload.sla_mix
    top = max(level for level, share in mix.items() if share > 0)
    metrics = {"objective.metric": tune.objective.metric}
    if tune.objective.constraint is not None:
        metrics["objective.constraint.metric"] = tune.objective.constraint.metric
    resolved = {}
    for key, template in metrics.items():
        try:
            name = template.format(top=top)
        except (KeyError, IndexError, ValueError):
            raise ConfigError(f"{path}: {key} '{template}': only {{top}} may be filled in") from None
        if not _known_metric(name):
            raise ConfigError(f"{path}: {key} '{name}': not a reproducible metric of experiments.catalogue")
        resolved[key] = name

    training = _windows(runs)
    windows = [{**w, "config": "training"} for w in training] + _check_held_out(tune, path, training)
    constraint = tune.objective.constraint
    return TunePlan(
        tune,
        str(path),
        base_config,
        distributions,
        default,
        runs,
        resolved["objective.metric"],
        resolved.get("objective.constraint.metric"),
        constraint.at_most_s if constraint else None,
        windows,
    )


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
                arm_set = _overrides(cfg, params)
                file = out / "trials" / f"{trial.number:03d}" / "ablation.yaml"
                doc = f"trial {trial.number} of `{command}`"
                header = f"# {doc}; rerun: preempt ablate --config {file} --out DIR\n"
                _write_yaml(file, _ablation_data(cfg, plan.base_config, arm_set, doc), header)
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
    _write_yaml(path, spec.model_dump(exclude={"reference"}), header)


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
