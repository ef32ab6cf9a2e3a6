"""Arms compared over seeds: pairing, paired intervals, and Pareto dominance from them.

Owns: pairing arms' rows by seed (`paired`: same seed = same requests, so differences
between arms are taken per seed), the objectives a policy is judged on (`OBJECTIVES`:
goodput, the top SLA class's TTFT p99 and its SLO attainment), and dominance judged by paired 95% intervals:

- B is *better* than A on an objective when the interval of B - A (paired by seed) lies
  wholly on the objective's good side, *worse* when it lies wholly on the other, *tied*
  otherwise (the interval holds 0, or there is no interval);
- B *dominates* A when B is better on at least one objective and worse on none;
- an arm is on the *front* of a point when no other arm there dominates it.

So "dominated" needs evidence on one objective and no evidence against on the other; an
arm cannot be called dominated by means alone. Plain Python over results rows (no
rendering: experiments.leaderboard draws and tabulates; experiments.claims judges).

Must never: pair rows of different seeds, or compare arms that did not run the same seeds
(`paired` keeps the seeds every named arm ran ok; none: None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from experiments.tables import sla_levels
from preempt.obs.stats import Interval, t_interval

Rows = list[dict[str, Any]]
Arms = dict[str, Rows]  # arm name -> its results rows, one per seed (+ "_config")

# Named after a system: each schedules as that system (docs/parity.md, docs/sglang.md,
# docs/fastserve.md). The leaderboard's and the claims' "named baselines".
BASELINE_PREFIXES = ("vllm_", "sglang_", "fastserve_")
# The simplest policy that uses a length estimate: shortest predicted remaining work first
# (docs/srpt.md), not named after a system but judged beside them (a design that reads an
# estimate must beat the plainest use of the same estimate); and UniBoost, named after its
# paper (docs/newer_baselines.md).
LENGTH_AWARE_BASELINES = ("srpt", "uniboost")
ORACLE_SUFFIX = "_oracle"
"""Arms told the truth about the future (true output lengths, arrivals): upper bounds,
never baselines or design arms a verdict rests on."""
DESIGN_ARMS = ("score", "score_learned", "score_tuned")
"""The design as specified (docs/design.md §1, its defaults: the remaining work is what
`max_tokens` allows), the same with the learned remaining-output estimate, and its tuned
variant (preempt/configs/tune.yaml); `preempt report --compare ARM` adds a user's own."""
BETTER, WORSE, TIED = "better", "worse", "tied"


def seed_of(row: dict[str, Any]) -> int:
    return int(row["_config"]["seed"])


def paired(arms: Arms, *names: str) -> list[Rows] | None:
    """Each arm's rows of the seeds that ran ok in every named arm, in seed order."""
    if any(name not in arms for name in names):
        return None
    seeds = [{seed_of(r) for r in arms[name] if r["status"] == "ok"} for name in names]
    common = set.intersection(*seeds)
    if not common:
        return None
    return [sorted((r for r in arms[name] if seed_of(r) in common), key=seed_of) for name in names]


def paired_interval(a: Rows, b: Rows, fn: Callable[[dict[str, Any], dict[str, Any]], float]) -> Interval:
    """Interval over seeds of fn(row of a, row of b); `a` and `b` from `paired`."""
    return t_interval([fn(x, y) for x, y in zip(a, b, strict=True)])


def top_level(rows: Rows) -> str:
    """The most important SLA level present in the rows' metrics (higher = more important)."""
    return sla_levels(rows)[-1]


def comparable(arms: Arms) -> Arms:
    """The arms that replay the same requests on the same pool and clock as most arms of the
    point: policies are compared on one workload, so an arm that brings its own (quick's
    tiny-model arms replay 30 s on 300 blocks) is left out."""

    def setting(name: str) -> str:
        config = next((r["_config"] for r in arms[name] if "_config" in r), {})
        scheduler = {k: v for k, v in (config.get("scheduler") or {}).items() if k != "policy"}
        return repr([config.get(k) for k in ("workload", "cache", "clock")] + [scheduler])

    groups: dict[str, list[str]] = {}
    for name in arms:
        groups.setdefault(setting(name), []).append(name)
    largest = max(groups.values(), key=len, default=[])
    return {name: arms[name] for name in largest}


def is_oracle(arm: str) -> bool:
    return arm.endswith(ORACLE_SUFFIX)


def is_baseline(arm: str) -> bool:
    """A named baseline (vllm_*, sglang_*, fastserve_*, uniboost) or the length-aware one,
    never an oracle arm."""
    return (arm.startswith(BASELINE_PREFIXES) or arm in LENGTH_AWARE_BASELINES) and not is_oracle(arm)


@dataclass(frozen=True)
class Objective:
    """A metric a policy is judged on. `metric` may name the top SLA class as `{top}`."""

    metric: str
    higher_is_better: bool
    label: str

    def column(self, rows: Rows) -> str:
        return self.metric.format(top=top_level(rows)) if "{top}" in self.metric else self.metric


OBJECTIVES = (
    Objective("goodput_req_s", True, "goodput req/s"),
    Objective("sla{top}_ttft_p99_s", False, "top class TTFT p99 s"),
    # TTFT alone credits a policy that admits the top class at once and then starves its
    # decode: FastServe's MLFQ, blind to classes, gives VIPs a TPOT p99 of 0.38 s against
    # their 0.05 s SLO at 2x load (docs/leaderboard.md). Their SLO attainment counts both.
    Objective("sla{top}_slo_attainment", True, "top class SLO attainment"),
)


DOMINATES, DOMINATED, TRADE = "dominates", "dominated", "trade"


def outcome(sides: Sequence[str]) -> str:
    """What one arm's sides against another's add up to: DOMINATES (better on one, worse
    on none), DOMINATED, TRADE (better on one, worse on another) or TIED."""
    if BETTER in sides:
        return TRADE if WORSE in sides else DOMINATES
    return DOMINATED if WORSE in sides else TIED


def side(diff: Interval, higher_is_better: bool) -> str:
    """BETTER / WORSE / TIED for the interval of (challenger - incumbent)."""
    if not diff.is_defined:
        return TIED
    if diff.lo > 0 or diff.hi < 0:
        above = diff.lo > 0
        return BETTER if above == higher_is_better else WORSE
    return TIED


@dataclass(frozen=True)
class Comparison:
    """`challenger` against `incumbent` at one point: per objective the paired interval of
    challenger - incumbent and its side."""

    challenger: str
    incumbent: str
    diffs: tuple[Interval, ...]
    sides: tuple[str, ...]
    num_seeds: int

    @property
    def dominates(self) -> bool:
        return outcome(self.sides) == DOMINATES

    @property
    def dominated(self) -> bool:
        return outcome(self.sides) == DOMINATED


def compare_arms(
    arms: Arms, challenger: str, incumbent: str, objectives: Sequence[Objective] = OBJECTIVES
) -> Comparison | None:
    """The paired comparison of two arms; None when they share no seed that ran ok."""
    rows = paired(arms, challenger, incumbent)
    if rows is None:
        return None
    c, i = rows
    diffs, sides = [], []
    for objective in objectives:
        column = objective.column(c)
        diff = paired_interval(c, i, lambda x, y, m=column: _value(x, m) - _value(y, m))
        diffs.append(diff)
        sides.append(side(diff, objective.higher_is_better))
    return Comparison(challenger, incumbent, tuple(diffs), tuple(sides), len(c))


def dominators(
    arms: Arms, names: Sequence[str], objectives: Sequence[Objective] = OBJECTIVES
) -> dict[str, list[str]]:
    """arm -> the arms among `names` that dominate it (empty: it is on the front)."""
    out: dict[str, list[str]] = {name: [] for name in names}
    for a in names:
        for b in names:
            if a != b:
                comparison = compare_arms(arms, b, a, objectives)
                if comparison is not None and comparison.dominates:
                    out[a].append(b)
    return out


def _value(row: dict[str, Any], metric: str) -> float:
    value = row.get(metric, math.nan)
    return float(value) if isinstance(value, int | float) else math.nan
