"""What a claim is and what judging one returns: the verdicts, `Finding`, `Claim` (judged
from an ablation's arms) and `BenchClaim` (from a benchmark's JSON), and the small pieces
every judge shares (intervals of a metric over seeds, their formatting, paired rows).

Must never: hold a number typed by hand (everything comes from `results.csv` and
`ablation.json`), or call a claim held when the arms it needs did not run, did nothing
(same metrics as their parent) or saw no event to judge by: those are "not measured by
this run" or "idle" (the mechanism never acted at that point), with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from experiments.dominance import Arms
from experiments.tables import metric_fingerprint
from preempt.obs.stats import Interval, metric_range, t_interval

HELD, NOT_HELD, INCONCLUSIVE, IDLE, NOT_MEASURED = (
    "held",
    "did not hold",
    "inconclusive",
    # The arms ran but the mechanism never acted (no priority preemption, a cap never
    # reached, a slice that never decided): no evidence either way, and not noise either.
    "idle",
    "not measured by this run",
)
DTYPE_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}


@dataclass(frozen=True)
class Finding:
    measured: str
    verdict: str


@dataclass(frozen=True)
class Claim:
    key: str
    source: str  # where the claim comes from (a docs/design.md section or field fact)
    text: str
    method: str  # how this report measures it
    evaluate: Callable[[Arms], Finding]
    regime: str = ""  # where its mechanism binds (docs/regimes.md), when the quick load is not it


def missing(arms: Arms, *names: str) -> Finding:
    absent = [n for n in names if n not in arms]
    if absent:
        return Finding(f"needs arm(s) {', '.join(absent)}", NOT_MEASURED)
    parts = []
    for n in names:
        bad = [r for r in arms[n] if r["status"] != "ok"]
        if bad:
            parts.append(f"{n} {bad[0]['status']}: {bad[0].get('notes') or ''}".strip())
    return Finding("; ".join(parts) or "no seed ran in every arm", NOT_MEASURED)


def same_metrics(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Identical metrics in every seed: the change never decided anything."""
    return all(metric_fingerprint(x) == metric_fingerprint(y) for x, y in zip(a, b, strict=True))


def interval_of(rows: list[dict[str, Any]], metric: str) -> Interval:
    return t_interval([float(r[metric]) for r in rows], bounds=metric_range(metric))


def fmt(iv: Interval, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    return iv.format(digits, scale, unit)


def show(rows: list[dict[str, Any]], metric: str, digits: int = 3, scale: float = 1.0) -> str:
    """The metric's mean over `rows` with its interval, formatted."""
    return interval_of(rows, metric).format(digits, scale, "")


# What a relative change of non-negative metrics can take: `a / b - 1` is at least -100%,
# a reduction `1 - a / b` at most 100% (the mean of per-seed ratios too, so the interval is
# clipped to it like a metric's; preempt.obs.stats).
RELATIVE_CHANGE = (-1.0, math.inf)
REDUCTION = (-math.inf, 1.0)


def pct(iv: Interval) -> str:
    if not iv.is_defined:
        return f"{iv.mean * 100:+.1f}% (n={iv.num}, no interval)"
    return f"{iv.mean * 100:+.1f}% [{iv.lo * 100:+.1f}%, {iv.hi * 100:+.1f}%]"


def all_of(*decisions: str | None) -> str:
    """Several interval checks that must all hold: any 'did not hold' decides; all 'held'
    hold; anything else is inconclusive."""
    if NOT_HELD in decisions:
        return NOT_HELD
    if decisions and all(d == HELD for d in decisions):
        return HELD
    return INCONCLUSIVE


def n_seeds(rows: list[dict[str, Any]]) -> str:
    return f"n={len(rows)} seeds"


def is_nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def relative(metric: str) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    def fn(x: dict[str, Any], y: dict[str, Any]) -> float:
        return x[metric] / y[metric] - 1 if y[metric] else math.nan

    return fn


def difference(metric: str) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    return lambda x, y: x[metric] - y[metric]


@dataclass(frozen=True)
class BenchClaim:
    """A claim judged from a benchmark's JSON (what `preempt bench NAME --json` prints), not
    from an ablation's arms: one verdict per report. `bench`: the benchmark's name (the
    report's `--NAME PATH` flag); `missing` says how to measure it when the report was given
    no such JSON."""

    bench: str
    key: str
    source: str
    text: str
    method: str
    evaluate: Callable[[dict[str, Any]], Finding]
    missing: str

    def judge(self, result: dict[str, Any] | None) -> Finding:
        if result is None:
            return Finding(self.missing, NOT_MEASURED)
        return self.evaluate(result)
