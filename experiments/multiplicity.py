"""Multiplicity control over a report's family of verdicts: Benjamini-Hochberg (the
default), Holm, or none.

A report judges a few hundred hypotheses, each "held" or "did not hold" only when its 95%
interval lies on one side of a bound. At 95% each, about one in twenty true nulls would
still get a decisive verdict. `adjust` judges the family again so that the share of wrong
decisive verdicts among all decisive ones stays under `alpha` in expectation (BH, the
false discovery rate) or the chance of any wrong one does (Holm, the family-wise error).

Every verdict here comes from intervals (preempt.obs.stats), not p-values, so both
procedures are run in their level form: a verdict's p-value is at most `a` exactly when it
is still decisive with every interval taken at level 1 - a (intervals at a stricter level
contain those at a looser one). So the judges are called again inside
`preempt.obs.stats.confidence(1 - a)`:

- Holm (step-down): a = alpha / m, then alpha / (m - r) with r the verdicts decisive so
  far, until no new one is; valid under any dependence between the verdicts.
- BH (step-up): the largest k such that k verdicts are decisive at a = k * alpha / m,
  found from k = the verdicts decisive at alpha downwards; valid for independent or
  positively dependent verdicts (Benjamini & Yekutieli 2001), which verdicts over the same
  seeds' runs typically are.

`m` counts the verdicts that tested something (held, did not hold, inconclusive); "idle"
and "not measured" ones tested nothing and stay as they are. A verdict decisive at 95% but
not after the correction becomes inconclusive.

Plain Python; the judges are the report's own (experiments.claims, experiments.headline).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from preempt.obs.stats import LEVEL, confidence

METHODS = ("bh", "holm", "none")
DECISIVE = ("held", "did not hold", "better", "worse")
TESTED = (*DECISIVE, "inconclusive", "tied")
ALPHA = 1.0 - LEVEL


@dataclass(frozen=True)
class Adjusted:
    """The family judged again. `verdicts`: each key's verdict after the correction (the
    per-verdict one where it tested nothing); `per_verdict`: at 95% each; `level`: the
    confidence the surviving verdicts were judged at; `changed`: the keys whose verdict
    the correction changed."""

    method: str
    alpha: float
    num_tests: int
    level: float
    per_verdict: dict[Hashable, str]
    verdicts: dict[Hashable, str]

    @property
    def changed(self) -> list[Hashable]:
        return [key for key, v in self.per_verdict.items() if self.verdicts[key] != v]

    @property
    def num_decisive(self) -> tuple[int, int]:
        """(decisive at 95% each, decisive after the correction)."""
        return (
            sum(v in DECISIVE for v in self.per_verdict.values()),
            sum(v in DECISIVE for v in self.verdicts.values()),
        )

    def describe(self) -> str:
        before, after = self.num_decisive
        if self.method == "none":
            return f"no multiplicity correction: {before} of {self.num_tests} verdicts decisive at 95% each"
        name = {"bh": "Benjamini-Hochberg (false discovery rate", "holm": "Holm (family-wise error"}[
            self.method
        ]
        return (
            f"{name} {self.alpha:g}) over the family of {self.num_tests} verdicts: {before} decisive at "
            f"95% each, {after} after the correction (judged at {100 * self.level:.4g}%)"
        )


def adjust(
    judges: Mapping[Hashable, Callable[[], str]], method: str = "bh", alpha: float = ALPHA
) -> Adjusted:
    """Each judge returns its verdict at the current confidence level; the family of them
    judged again with `method` ("bh", "holm" or "none")."""
    if method not in METHODS:
        raise ValueError(f"multiplicity method must be one of {', '.join(METHODS)}, got {method!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    with confidence(1.0 - alpha):
        first = {key: judge() for key, judge in judges.items()}
    tested = [key for key, v in first.items() if v in TESTED]
    m = len(tested)
    decisive = [key for key in tested if first[key] in DECISIVE]
    if method == "none" or not decisive:
        return Adjusted(method, alpha, m, 1.0 - alpha, first, dict(first))

    def judged_at(a: float, keys: list[Hashable]) -> dict[Hashable, str]:
        with confidence(1.0 - a):
            return {key: judges[key]() for key in keys}

    if method == "holm":
        rejected: dict[Hashable, str] = {}
        while True:
            level = 1.0 - alpha / (m - len(rejected))
            now = {key: v for key, v in judged_at(1.0 - level, decisive).items() if v in DECISIVE}
            if len(now) <= len(rejected):
                break
            rejected = now
    else:
        k = len(decisive)
        while True:
            level = 1.0 - alpha * k / m
            rejected = {key: v for key, v in judged_at(1.0 - level, decisive).items() if v in DECISIVE}
            if len(rejected) >= k or not rejected:
                break
            k = len(rejected)
    verdicts = dict(first)
    for key in decisive:
        verdicts[key] = rejected.get(
            key, "inconclusive" if first[key] in ("held", "did not hold") else "tied"
        )
    return Adjusted(method, alpha, m, level, first, verdicts)
