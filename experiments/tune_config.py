"""The tune config and its resolution into trials: `preempt/configs/tune.yaml`.

Owns: the schema of a tune config (pydantic, frozen, unknown keys rejected; every error
one `ConfigError` naming the key, before anything runs) -- the parent arm, the search
space, the training points, the objective and its constraint -- and `plan_tune`, which
checks it against the engine config and the held-out judge's windows and resolves the
parent's own values (trial 0). The study that runs it is experiments.tune's.

Must never: accept a training window that a held-out judge replays (`held_out:`,
load.yaml by default), or run anything.
"""

from __future__ import annotations

import copy
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from experiments.catalogue import METRICS, NOT_REPRODUCIBLE, SLA_METRICS
from experiments.plan import ArmRun, plan_ablation
from preempt.core.config import ConfigError, build_config, format_validation_error
from preempt.core.config_files import find_config_file, set_dotted

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


def ablation_data(tune: TuneConfig, base_config: str | None, arm_set: dict[str, Any], doc: str) -> dict:
    data: dict[str, Any] = {"name": tune.name, "description": doc}
    if base_config is not None:
        data["base_config"] = base_config
    data.update(base=tune.base, grid=tune.grid, replicate=tune.replicate, wandb_project=tune.wandb_project)
    if tune.seeds is not None:
        data["seeds"] = tune.seeds
    data["arms"] = [{"name": tune.name, "parent": tune.parent, "set": arm_set, "doc": doc}]
    return data


def write_yaml(path: Path, data: dict[str, Any], header: str = "") -> None:
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
            runs = plan_ablation(find_config_file(name, beside=path.parent), scratch).runs
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


def trial_overrides(tune: TuneConfig, params: dict[str, Any]) -> dict[str, Any]:
    """A trial's overrides of the parent: the fixed `set`, its values, then `set_when`."""
    values = {**tune.set, **params}
    for rule in tune.set_when:
        if all(k in values and _same(values[k], v) for k, v in rule.when.items()):
            values.update(rule.set)
    return values


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # true is not 1


def load_tune_config(path: str | Path) -> TuneConfig:
    from preempt.core.config_files import read_config_file

    try:
        return TuneConfig.model_validate(read_config_file(path))
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, 'key', TuneConfig)}") from None


def plan_tune(path: str | Path) -> TunePlan:
    """Validate the tune config at `path` (space, objective, training points, held-out
    windows) and resolve the parent at every training point. Raises ConfigError naming
    the key. Writes nothing."""
    path = Path(path)
    tune = load_tune_config(path)
    if tune.name == tune.parent:
        raise ConfigError(f"{path}: name '{tune.name}': must differ from parent (it names the tuned arm)")
    base_config = (
        str(find_config_file(tune.base_config, beside=path.parent).resolve()) if tune.base_config else None
    )
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "parent.yaml"
        write_yaml(file, ablation_data(tune, base_config, {}, "the parent"))
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
