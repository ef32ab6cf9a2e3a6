"""A claim that is one paired interval against a bound, declared as data.

`PairedTest` names the two arms, the metric, the contrast (`arm - factor x baseline`,
per seed: seeds of two arms replay the same requests), the bound and the side the claim
says the interval lies on, and what makes the test idle (the mechanism never acted).
`judge` is the one function that evaluates every declaration; `describe` writes its
method text from the same fields, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from experiments.claims.base import IDLE, INCONCLUSIVE, Claim, Finding, fmt, missing, n_seeds, show
from experiments.dominance import Arms, paired, paired_interval, top_level
from preempt.obs.stats import compare

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class PairedTest:
    baseline: str
    arm: str
    metric: str  # a results column; `{top}` is the top SLA level of the arm's rows
    label: str  # the metric in the measured text (`{top}` as in `metric`)
    method_label: str  # the metric in the method text
    unit: str
    bound: float = 0.0
    side: Literal["below", "above"] = "below"  # where the claim puts the interval
    factor: float = 1.0  # the contrast is arm - factor x baseline
    baseline_note: str = ""  # what the baseline is, in the method text
    # (baseline rows, arm rows, metric column) -> why the test is idle, or None
    idle: Callable[[Rows, Rows, str], str | None] | None = None
    idle_note: str = ""  # when it is idle, in the method text

    @property
    def contrast(self) -> str:
        if self.factor == 1.0:
            return "difference"
        return f"{self.arm} - {self.factor:g} x {self.baseline}"


def judge(test: PairedTest, arms: Arms) -> Finding:
    """The paired interval of `test.arm - test.factor x test.baseline` on the metric,
    against the bound: held or did not hold when it lies on one side, else inconclusive;
    idle when `test.idle` says the mechanism never acted."""
    rows = paired(arms, test.baseline, test.arm)
    if rows is None:
        return missing(arms, test.baseline, test.arm)
    base, arm = rows
    top = top_level(arm) if "{top}" in test.metric + test.label else ""
    key, label = test.metric.format(top=top), test.label.format(top=top)
    contrast = paired_interval(arm, base, lambda x, y: x[key] - test.factor * y[key])
    measured = (
        f"{label} {show(base, key)} {test.unit} ({test.baseline}) -> "
        f"{show(arm, key)} {test.unit} ({test.arm}); {test.contrast} {fmt(contrast)} "
        f"{test.unit} ({n_seeds(arm)})"
    )
    if test.idle is not None and (reason := test.idle(base, arm, key)):
        return Finding(f"{measured}; {reason}", IDLE)
    return Finding(measured, compare(contrast, test.bound, claimed=test.side) or INCONCLUSIVE)


def describe(test: PairedTest) -> str:
    """The method text of `test`, from its fields."""
    other = "above" if test.side == "below" else "below"
    scaled = "" if test.factor == 1.0 else f"{test.factor:g} x "
    note = f" ({test.baseline_note})" if test.baseline_note else ""
    idle = f"; idle when {test.idle_note}" if test.idle_note else ""
    return (
        f"{test.method_label} of `{test.arm}` - {scaled}`{test.baseline}`{note}, paired by seed, in "
        f"{test.unit}: interval {test.side} {test.bound:g} held, {other} did not hold{idle}"
    )


def paired_claim(key: str, source: str, text: str, test: PairedTest, regime: str = "") -> Claim:
    """A `Claim` judged by `judge(test, ...)`, its method text from `describe(test)`."""
    return Claim(key, source, text, describe(test), partial(judge, test), regime=regime)
