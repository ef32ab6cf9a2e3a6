"""The ablation matrix: which arms exist, the ablation config, and its resolution into runs.

Owns: the registry of standard arms (`STANDARD_ARMS`: the field's baselines, then the
the design of docs/design.md added one piece at a time), the schema of an ablation config file
(`experiments/configs/*.yaml`, pydantic, frozen, unknown keys rejected), and
`plan_ablation`, which turns a config into the list of runs with their full, validated
engine configs. Every error (unknown arm, unknown or mistyped key, an override that makes
an invalid engine config, a missing reference) is raised here as one `ConfigError` line
naming the arm and key, before anything runs.

Must never: run anything or import torch. It writes in the output directory only the
inputs a grid point derives (`OUT/inputs/`, `experiments.derive`).

An arm is a name, a parent and dotted overrides (the semantics of `preempt run --set`);
its engine config is the ablation's `base` + the overrides of its ancestors, root first,
+ its own + the grid point's. Baselines set every knob they depend on, so a base config
cannot leak the design into them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from experiments.derive import DERIVED_PREFIX, apply_derived
from preempt.core.config import (
    ConfigError,
    EarlySaveConfig,
    EngineConfig,
    build_config,
    find_config_file,
    format_validation_error,
    parse_assignment,
    read_config_file,
    set_dotted,
)

# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Arm:
    """One configuration of the matrix. `set`: dotted engine-config overrides applied on
    top of the parent's; `reference`: the arm whose `preemptions.parquet` an `oracle`
    early-save arm replays (it runs first, at the same grid point)."""

    name: str
    parent: str | None
    set: Mapping[str, Any]
    doc: str
    reference: str | None = None


def _arms(*arms: Arm) -> dict[str, Arm]:
    return {arm.name: arm for arm in arms}


STANDARD_ARMS: dict[str, Arm] = _arms(
    # -- the field's baselines (docs/design.md "Facts from the field")
    Arm(
        "vllm_fcfs",
        None,
        {
            "scheduler.policy": "vllm_fcfs",
            "preemption.mode": "recompute",
            "preemption.time_slice_strategy": "static",
            "preemption.max_preemption_per_min": None,
            "early_save.policy": "none",
        },
        "vLLM 0.32.0 V1 (step-identical, docs/parity.md): preempt only when KV blocks run out, "
        "recompute, victim = last admitted",
    ),
    Arm(
        "vllm_priority",
        "vllm_fcfs",
        {"scheduler.policy": "vllm_priority"},
        "vLLM V1 priority scheduling: victim = worst (priority, arrival), recompute",
    ),
    Arm(
        "fcfs_swap",
        "vllm_fcfs",
        {"preemption.mode": "swap"},
        "vLLM 0.32's scheduling with the victim's raw KV swapped to host and back (vLLM V0's "
        "swap mode; not V0's scheduler, hence no system name)",
    ),
    Arm(
        "sglang_priority",
        "vllm_fcfs",
        {"scheduler.policy": "sglang_priority"},
        "SGLang 0.5.23 with priority scheduling: its own loop (prefill first, new-token-ratio "
        "admission, retraction by fewest outputs), priority preemption past the threshold, "
        "recompute, no radix cache (docs/sglang.md)",
    ),
    Arm(
        "sglang_fcfs",
        "sglang_priority",
        {"scheduler.policy": "sglang_fcfs"},
        "SGLang 0.5.23's default fcfs: no priority scheduling, no priority preemption",
    ),
    # -- the design (docs/design.md), one piece at a time
    Arm(
        "score",
        "vllm_priority",
        {"scheduler.policy": "priority_score", "preemption.threshold": 0.2},
        "docs/design.md §1: priority score + 20% trigger margin (one static slice, recompute, no cap)",
    ),
    Arm(
        "score_age_cap",
        "score",
        {"preemption.priority_weights.age_cap_s": 10.0},
        "a named variant of the design: the age term saturates at 10 s, so waiting orders requests "
        "within an SLA level but never lifts one over a level (at the quick weights 0.05/s x 10 s "
        "= 0.5 < 0.8 a level); the suspect in the top class's TTFT p99 against strict priority",
    ),
    Arm(
        "score_learned",
        "score",
        {"preemption.remaining": "learned"},
        "the design with a learned estimate of the remaining output (preempt.engine.remaining: "
        "expected output left given prompt length, cap and tokens so far, fitted outside the "
        "replayed window, re-estimated every token) instead of what max_tokens allows",
    ),
    Arm(
        "score_oracle",
        "score",
        {"preemption.remaining": "oracle"},
        "oracle: the design told each request's true output length (an upper bound on what "
        "length knowledge is worth to it)",
    ),
    Arm("threshold_0", "score", {"preemption.threshold": 0.0}, "score with no margin (sensitivity)"),
    Arm("threshold_50", "score", {"preemption.threshold": 0.5}, "score with a 50% margin (sensitivity)"),
    Arm(
        "slices_dynamic",
        "score",
        {"preemption.time_slice_strategy": "dynamic"},
        "docs/design.md §3: time slice by request length (50/20/10 ms) instead of one static slice",
    ),
    Arm(
        "rate_limit",
        "slices_dynamic",
        {"preemption.max_preemption_per_min": 30},
        "docs/design.md §6: at most 30 priority preemptions per minute",
    ),
    Arm(
        "rate_limit_tight",
        "slices_dynamic",
        {"preemption.max_preemption_per_min": 8},
        "a cap of 8 priority preemptions per minute: under the quick load's uncapped peak (7-17), "
        "so the cap decides and its cost shows",
    ),
    Arm(
        "pause",
        "rate_limit",
        {"preemption.mode": "pause", "preemption.async_restore": True},
        "docs/design.md §4: zero-copy pause; KV moves only when its blocks are reclaimed (restored "
        "asynchronously then)",
    ),
    Arm(
        "swap_zstd",
        "rate_limit",
        {"preemption.mode": "swap_zstd", "preemption.async_restore": True},
        "docs/design.md §2: save KV with zstd (level 3) to the host pool (serve_config.json's design); "
        "restores asynchronous: a readmitted request waits out of the batch for its copy-in",
    ),
    Arm(
        "swap_zstd_static",
        "swap_zstd",
        {"preemption.time_slice_strategy": "static"},
        "swap_zstd with one static slice: the dynamic-slice claim on a saving mode",
    ),
    Arm(
        "swap_raw",
        "swap_zstd",
        {"preemption.mode": "swap"},
        "the design saving raw KV: isolates what zstd costs on the critical path",
    ),
    Arm(
        "swap_raw_sync",
        "swap_raw",
        {"preemption.async_restore": False},
        "swap_raw with synchronous restores (the batch waits for each copy-in, as vLLM V0's swap): "
        "what asynchronous restores win",
    ),
    Arm(
        "swap_mixed",
        "swap_zstd",
        {"preemption.mode": "swap_mixed"},
        "docs/design.md §9: mixed-precision save (FP16/FP8/drop per KV head), lossy",
    ),
    Arm(
        "swap_fp8",
        "swap_mixed",
        {"preemption.head_plan": "fp8"},
        "uniform FP8 (E4M3, per-head scales): the field's baseline for lossy saves, 2x smaller",
    ),
    # -- slices that decide (time sharing) and FastServe's MLFQ
    Arm(
        "time_share_dynamic",
        "pause",
        {"preemption.slice_mode": "quantum"},
        "docs/design.md §3 as time sharing: a request that used its slice yields its seat to the best "
        "waiting one of its level or above (KV paused, saved if its blocks are needed)",
    ),
    Arm(
        "time_share_static",
        "time_share_dynamic",
        {"preemption.time_slice_strategy": "static"},
        "time sharing with one static slice: the dynamic-slice claim where slices decide",
    ),
    Arm(
        "time_share_swap",
        "time_share_dynamic",
        {"preemption.mode": "swap"},
        "time sharing whose yields save raw KV and restore it: the zero-copy pause's twin where "
        "preempted requests resume soon",
    ),
    Arm(
        "time_share_uncapped",
        "time_share_dynamic",
        {"preemption.max_preemption_per_min": None},
        "time sharing without the 30-per-minute cap: every used-up slice may yield (the rate cap's "
        "twin where it binds)",
    ),
    Arm(
        "time_share_uncapped_static",
        "time_share_uncapped",
        {"preemption.time_slice_strategy": "static"},
        "uncapped time sharing with one static slice: the dynamic-slice claim without the cap",
    ),
    Arm(
        "fastserve_mlfq",
        "vllm_fcfs",
        {
            "scheduler.policy": "fastserve_mlfq",
            # Proactive KV management as FastServe's artifact does it (docs/fastserve.md): a
            # request out of the batch keeps its KV on the GPU until its blocks are needed,
            # then it is swapped out raw, lowest queue first; swap-ins run beside compute and
            # the next requests' KV is swapped in ahead, up to a batch's worth.
            "preemption.mode": "pause",
            "preemption.reclaim_codec": "raw",
            "preemption.async_restore": True,
            "early_save.prefetch": True,
            "early_save.prefetch_depth": 16,
            "early_save.prefetch_block_share": 1.0,
        },
        "FastServe (arXiv 2305.05920; its artifact's rules, docs/fastserve.md): skip-join MLFQ at "
        "iteration granularity, starvation promotion, KV kept on the GPU until needed, swapped out "
        "raw and in ahead",
    ),
    Arm(
        "srpt",
        "vllm_fcfs",
        {"scheduler.policy": "srpt", "preemption.remaining": "learned"},
        "the length-aware baseline (docs/srpt.md): shortest learned remaining work first "
        "(Fu et al. 2024; Trail, ICLR 2025), a 5 s starvation guard, preemption only in the "
        "first half of a request's expected output, recompute; no SLA classes",
    ),
    Arm(
        "srpt_oracle",
        "srpt",
        {"preemption.remaining": "oracle"},
        "oracle: srpt told each request's true output length (an upper bound)",
    ),
    Arm(
        "early_always",
        "swap_mixed",
        {"early_save.policy": "always"},
        "early saves of every running request (write-through, like SGLang HiCache)",
    ),
    Arm(
        "early_rule",
        "swap_mixed",
        {"early_save.policy": "rule"},
        "early save of the lowest-priority request whose slice is used up",
    ),
    Arm(
        "early_lstm",
        "swap_mixed",
        {"early_save.policy": "lstm"},
        "docs/design.md §8: early saves triggered by the trained LSTM predictor (needs `predictor`)",
    ),
    Arm(
        "early_oracle",
        "swap_mixed",
        {"early_save.policy": "oracle"},
        "early saves from the reference run's real preemptions (upper bound)",
        reference="swap_mixed",
    ),
    Arm(
        "early_forecast",
        "swap_mixed",
        {
            "early_save.policy": "forecast",
            "early_save.horizon_steps": 4,
            "early_save.lookahead_every_steps": 4,
        },
        "early saves from a fork of the engine knowing only the present, forked on news or every 4 steps",
    ),
)


TUNED_ARM = Path(__file__).parent / "configs" / "score_tuned.yaml"
"""`score_tuned`: the best trial of `preempt tune --config experiments/configs/tune.yaml`
(its best.yaml, committed as is; the study's summary: benchmarks/tune_*.json). A named
variant of the design, never its default: `score` keeps the specified values."""


def _tuned_arm(path: Path) -> Arm:
    spec = yaml.safe_load(path.read_text())
    return Arm(spec["name"], spec["parent"], spec["set"], spec["doc"])


_TUNED = _tuned_arm(TUNED_ARM)
STANDARD_ARMS[_TUNED.name] = _TUNED
# The tuned design with each other remaining-work estimate: what length knowledge is worth
# to it (the claims report's oracle share, per design arm).
for _remaining, _doc in (
    ("learned", "the tuned design with the learned estimate of the remaining output"),
    ("oracle", "oracle: the tuned design told each request's true output length (an upper bound)"),
):
    _arm = Arm(f"{_TUNED.name}_{_remaining}", _TUNED.name, {"preemption.remaining": _remaining}, _doc)
    STANDARD_ARMS[_arm.name] = _arm

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
    (experiments/configs/, e.g. `engine_quick.yaml`)."""
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
    verdicts then carry 95% intervals over seeds (experiments.stats). None: one run with
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
        raise ConfigError(f"{path}: {format_validation_error(err, 'key')}") from None


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
