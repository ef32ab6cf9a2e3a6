"""An ablation config file and its resolution into runs.

Owns: the schema of an ablation config file (`preempt/configs/*.yaml`, pydantic, frozen,
unknown keys rejected) and `plan_ablation`, which turns a config into the list of runs
with their full, validated engine configs, arms taken from experiments.arms
(`STANDARD_ARMS`) or defined in the file. Every error (unknown arm, unknown or mistyped
key, an override that makes an invalid engine config, a missing reference) is raised
here as one `ConfigError` line naming the arm and key, before anything runs.

Must never: run anything or import torch. It writes in the output directory only the
inputs a grid point derives (`OUT/inputs/`, `experiments.derive`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from experiments.arms import STANDARD_ARMS, Arm
from experiments.derive import DERIVED_PREFIX, apply_derived
from preempt.core.config import (
    ConfigError,
    EarlySaveConfig,
    EngineConfig,
    build_config,
    format_validation_error,
)
from preempt.core.config_files import find_config_file, parse_assignment, read_config_file, set_dotted

# ---------------------------------------------------------------- the config file


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ArmSpec(_Frozen):
    """An arm defined in the config file (it may shadow a standard arm of the same name)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    parent: str | None = None
    set: dict[str, Any] = Field(default_factory=dict)
    """Dotted engine-config key -> value (YAML-typed, as `preempt run --set` parses)."""
    doc: str = ""
    reference: str | None = None


class AblationConfig(_Frozen):
    """One ablation or sweep: a base engine config, the arms run on it, the grid of points
    and the seeds, and what the arms need."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the wandb group and the results."""
    description: str = ""
    base_config: str | None = None
    """An engine config file (JSON/YAML, e.g. serve_config.json) under `base`; a relative
    path is looked up beside the ablation config, then among the bundled configs
    (preempt/configs/, e.g. `engine_quick.yaml`)."""
    base: dict[str, Any] = Field(default_factory=dict)
    """Engine config sections shared by every arm (same keys as `preempt run --config`)."""
    arms: list[str | ArmSpec] = Field(min_length=1)
    """Standard arm names (experiments.arms.STANDARD_ARMS) and/or arm definitions."""
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    """Dotted key -> values: every arm runs at every point of the product (e.g.
    `workload.rate_scale: [1, 2, 4]`). Keys under `derive.` are inputs made for the point
    (`experiments.derive`: `derive.link_gb_s`, `derive.prompt_scale`)."""
    seeds: list[int] | None = Field(None, min_length=1)
    """Every arm at every grid point runs once per seed (`seed` of the engine config: which
    requests are of which SLA class, prompts, synthetic arrivals); tables, plots and
    verdicts then carry 95% intervals over seeds (preempt.obs.stats). None: one run with
    the base's seed."""
    replicate: dict[str, list[Any]] = Field(default_factory=dict)
    """Dotted key -> one value per seed, set with it: what else differs between the
    replicates, e.g. `workload.start_s: [0, 600, 1200, 1800, 2400]` replays a different
    window of the real trace per seed (with trace arrivals the seed alone only redraws the
    SLA classes and prompt tokens). Not part of the run key: it is the seed's. An arm that
    sets one of these keys itself (or through its parents) keeps its own value."""
    predictor: str | None = None
    """predictor.ckpt for `lstm` early-save arms (`--predictor` overrides). Without one,
    those arms are skipped with a note; a path that does not exist is an error."""
    quality_reference: str | None = None
    """A lossless arm whose output tokens every other arm is scored against (greedy
    agreement). Only meaningful with a backend that computes real tokens (`tiny`, `hf`)."""
    wandb_project: str = "preempt-ablations"

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    @model_validator(mode="after")
    def _one_value_per_seed(self) -> AblationConfig:
        for key, values in self.replicate.items():
            if self.seeds is None or len(values) != len(self.seeds):
                raise ValueError(f"replicate '{key}': needs one value per seed ({len(self.seeds or [])})")
        return self


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ArmRun:
    """One run of the plan: an arm at one grid point, with its full engine config."""

    key: str  # unique: the arm name, plus "@k=v,..." with a grid
    arm: str
    parent: str | None  # the parent arm's run key at the same grid point, if it runs
    reference: str | None  # the run whose preemptions.parquet it replays
    grid_point: dict[str, Any]
    own_set: dict[str, Any]  # the arm's own overrides: what it adds to its parent
    doc: str
    config: EngineConfig
    skip_reason: str | None = None


@dataclass(frozen=True)
class AblationPlan:
    config: AblationConfig
    source: str  # the config file it came from
    runs: list[ArmRun]
    base: dict[str, Any] = field(default_factory=dict)  # base engine dict, overrides applied
    predictor: str | None = None

    def run(self, key: str) -> ArmRun:
        return next(r for r in self.runs if r.key == key)


def load_ablation_config(path: str | Path) -> AblationConfig:
    try:
        return AblationConfig.model_validate(read_config_file(path))
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, 'key', AblationConfig)}") from None


def _lookup(name: str, custom: dict[str, Arm], where: str) -> Arm:
    if name in custom:
        return custom[name]
    if name in STANDARD_ARMS:
        return STANDARD_ARMS[name]
    known = sorted(set(STANDARD_ARMS) | set(custom))
    raise ConfigError(f"{where}: unknown arm '{name}'; known arms: {', '.join(known)}")


def chain_overrides(name: str, custom: dict[str, Arm] | None = None) -> list[tuple[str, Any]]:
    """The overrides of `name` and its ancestors, root first."""
    custom = custom or {}
    chain: list[Arm] = []
    seen: set[str] = set()
    arm: Arm | None = _lookup(name, custom, "arms")
    while arm is not None:
        if arm.name in seen:
            raise ConfigError(f"parent cycle through '{arm.name}'")
        seen.add(arm.name)
        chain.append(arm)
        # the caller names the arm asked for (`arm 'x': ...`); an ancestor's is named here
        where = "parent" if arm.name == name else f"parent of '{arm.name}'"
        arm = _lookup(arm.parent, custom, where) if arm.parent else None
    return [item for arm in reversed(chain) for item in arm.set.items()]


def _grid_points(grid: dict[str, list[Any]], seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """The product of the grid, then each point once per seed (`seed` last in the point)."""
    for key, values in grid.items():
        if not values:
            raise ConfigError(f"grid key '{key}': needs at least one value")
        if key == "seed":
            raise ConfigError("grid key 'seed': list seeds under `seeds:` (replicates, not a grid axis)")
    keys = list(grid)
    points = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())] or [{}]
    if seeds is None:
        return points
    return [{**point, "seed": seed} for point in points for seed in seeds]


def without_seed(point: dict[str, Any]) -> dict[str, Any]:
    """A run's grid point without its seed: the point its seeds are replicates of."""
    return {k: v for k, v in point.items() if k != "seed"}


def run_key(arm: str, point: dict[str, Any]) -> str:
    if not point:
        return arm
    return arm + "@" + ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())


def _without_early_save(config: EngineConfig) -> dict[str, Any]:
    return config.model_copy(update={"early_save": EarlySaveConfig()}).model_dump(mode="json")


def plan_ablation(
    path: str | Path,
    out_dir: str | Path,
    *,
    overrides: list[str] = (),
    predictor: str | None = None,
    only: list[str] | None = None,
    final_overrides: list[str] = (),
) -> AblationPlan:
    """Validate the ablation at `path` and resolve every run's engine config.

    `overrides` (`--set k=v`) apply to the base; `final_overrides` after each arm's own
    (a sweep's parameters, which must win over the arm's); `predictor` (`--predictor`)
    replaces the config's; `only` keeps a subset of the arms. `out_dir` fixes where oracle
    arms find their reference's preemption log. Raises ConfigError, naming the arm and
    key."""
    path = Path(path)
    ablation = load_ablation_config(path)
    base: dict[str, Any] = {}
    if ablation.base_config:
        base = read_config_file(find_config_file(ablation.base_config, beside=path.parent))
    for section, values in ablation.base.items():
        if isinstance(values, dict) and isinstance(base.get(section), dict):
            base[section] = {**base[section], **values}
        else:
            base[section] = values
    for assignment in overrides:
        key, value = parse_assignment(assignment)
        set_dotted(base, key, value)
    try:
        build_config(base)
    except ConfigError as err:
        raise ConfigError(f"{path}: base: {err}") from None

    predictor = predictor if predictor is not None else ablation.predictor
    if predictor is not None and not Path(predictor).is_file():
        raise ConfigError(f"predictor checkpoint not found: {predictor}")

    custom = {
        spec.name: Arm(spec.name, spec.parent, spec.set, spec.doc, spec.reference)
        for spec in ablation.arms
        if isinstance(spec, ArmSpec)
    }
    names = [spec if isinstance(spec, str) else spec.name for spec in ablation.arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: arms: an arm is listed twice")
    for name in names:
        _lookup(name, custom, f"{path}: arms")
    if ablation.quality_reference is not None and ablation.quality_reference not in names:
        raise ConfigError(f"{path}: quality_reference '{ablation.quality_reference}' is not among the arms")
    if only:  # a subset (--arms, a sweep): without its quality reference, quality stays NaN
        unknown = [name for name in only if name not in names]
        if unknown:
            raise ConfigError(f"--arms: '{unknown[0]}' is not an arm of {path}; its arms: {', '.join(names)}")
        names = [name for name in names if name in only]

    runs: list[ArmRun] = []
    configs: dict[str, EngineConfig] = {}
    for point in _grid_points(ablation.grid, ablation.seeds):
        for name in names:
            arm = _lookup(name, custom, "arms")
            data = yaml.safe_load(yaml.safe_dump(base))  # deep copy, plain types
            skip_reason = None
            try:
                pinned = set()
                for key, value in chain_overrides(name, custom):
                    set_dotted(data, key, value)
                    pinned.add(key)
                for key, value in point.items():
                    if not key.startswith(DERIVED_PREFIX):
                        set_dotted(data, key, value)
                if "seed" in point:  # what else this replicate changes, unless the arm pins it
                    index = ablation.seeds.index(point["seed"])
                    for key, values in ablation.replicate.items():
                        if key not in pinned:
                            set_dotted(data, key, values[index])
                for assignment in final_overrides:
                    set_dotted(data, *parse_assignment(assignment))
                for key, value in point.items():  # last: they derive from the settled config
                    if key.startswith(DERIVED_PREFIX):
                        apply_derived(data, key, value, Path(out_dir))
                early = data.get("early_save", {})
                if isinstance(early, dict) and early.get("policy") == "lstm" and not early.get("checkpoint"):
                    if predictor is None:
                        skip_reason = (
                            "no predictor checkpoint: pass --predictor PATH or set `predictor:` "
                            "(train one with `preempt collect` + `preempt train`)"
                        )
                    set_dotted(data, "early_save.checkpoint", predictor or "<no predictor>")
                reference = None
                if arm.reference is not None:
                    if arm.reference not in names:
                        raise ConfigError(f"reference arm '{arm.reference}' must be among the arms run")
                    reference = run_key(arm.reference, point)
                    log = Path(out_dir) / "arms" / reference / "preemptions.parquet"
                    set_dotted(data, "early_save.oracle_log", str(log))
                config = build_config(data)
            except ConfigError as err:
                raise ConfigError(f"{path}: arm '{name}': {err}") from None
            key = run_key(name, point)
            parent = run_key(arm.parent, point) if arm.parent in names else None
            runs.append(
                ArmRun(key, name, parent, reference, point, dict(arm.set), arm.doc, config, skip_reason)
            )
            configs[key] = config

    for run in runs:  # an oracle replays a run that differs from it only in early saves
        if run.reference is None:
            continue
        ref = configs[run.reference]
        if ref.early_save.policy != "none" or _without_early_save(ref) != _without_early_save(run.config):
            raise ConfigError(
                f"{path}: arm '{run.arm}': reference arm '{run.reference}' must have the same "
                "config with early_save.policy none"
            )
    return AblationPlan(ablation, str(path), runs, base, predictor)
