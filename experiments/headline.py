"""The headline comparison that opens the results page: every deployable baseline and the
design on the bundled Azure traces (preempt/configs/headline.yaml), per regime (trace x
load).

Owns, from the headline ablation's rows (results.csv, summary.csv, ablation.json):
- "which policy should I use?": per regime one deployable arm by a stated rule
  (`recommend`), with the sentence that says why;
- the headline claim, judged directly per design arm and regime (`within_strict_priority`):
  within 10% of strict priority's top-class TTFT p99 *and* higher goodput;
- the design against every baseline on each objective (`comparison_judges`), the verdicts
  a multiplicity correction adjusts (experiments.multiplicity), and what they add up to
  (dominates, dominated, a trade, tied);
- every class's SLO attainment and TTFT p99 per arm, with 95% intervals.

Which arms are which: `*_oracle` arms know the future and are shown apart (never picked,
never a verdict); a named baseline is `experiments.dominance.is_baseline`; every other arm
is a variant of the design.

Must never: pick an oracle arm, or call a regime's pick without the numbers it rests on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from experiments.dominance import (
    OBJECTIVES,
    WORSE,
    Arms,
    Objective,
    compare_arms,
    is_baseline,
    is_oracle,
    outcome,
    paired,
    top_level,
)
from experiments.tables import interval_cell, sla_levels
from preempt.obs.stats import compare, ratio_interval, t_interval

STRICT_PRIORITY = "vllm_priority"
"""Strict priority, the reference of the headline claim: vLLM's own priority scheduling."""
WITHIN = 0.10
"""The headline claim's allowance on strict priority's top-class TTFT p99."""
TOP_ATTAINMENT = next(o for o in OBJECTIVES if o.metric == "sla{top}_slo_attainment")

HELD, NOT_HELD, INCONCLUSIVE, NOT_MEASURED = "held", "did not hold", "inconclusive", "not measured"


@dataclass(frozen=True)
class Point:
    """One regime of the headline: its label (`trace=azure-code, rate_scale=4.0`), every
    arm's rows over seeds, the summary rows (means and intervals), and each arm's doc."""

    label: str
    arms: Arms
    summary: Mapping[str, dict[str, Any]]
    docs: Mapping[str, str]

    @property
    def deployable(self) -> list[str]:
        return [a for a in self.arms if not is_oracle(a) and _ok(self.arms[a])]

    @property
    def baselines(self) -> list[str]:
        return [a for a in self.deployable if is_baseline(a)]

    @property
    def design(self) -> list[str]:
        return [a for a in self.deployable if not is_baseline(a)]

    def mean(self, arm: str, metric: str) -> float:
        row = self.summary.get(arm, {})
        value = row.get(metric, math.nan)
        return float(value) if isinstance(value, int | float) else math.nan

    def top(self) -> str:
        return top_level([r for rows in self.arms.values() for r in rows if r["status"] == "ok"])


def _ok(rows: list[dict[str, Any]]) -> bool:
    return any(r["status"] == "ok" for r in rows)


# ---------------------------------------------------------------- the headline claim


@dataclass(frozen=True)
class Judged:
    verdict: str
    measured: str


def within_strict_priority(arms: Arms, arm: str, reference: str = STRICT_PRIORITY) -> Judged:
    """`arm`'s top-class TTFT p99 at most (1 + WITHIN) x the reference's (Fieller's
    interval of the ratio of the paired means) and its goodput higher (paired interval
    of the difference): held when both intervals say so, did not hold when either says
    the opposite, else inconclusive."""
    rows = paired(arms, arm, reference)
    if rows is None:
        return Judged(NOT_MEASURED, f"needs {arm} and {reference} on common seeds")
    mine, ref = rows
    ttft = f"sla{top_level(ref)}_ttft_p99_s"
    # a ratio of non-negative times is non-negative (Fieller's interval may reach below 0)
    ratio = ratio_interval([r[ttft] for r in mine], [r[ttft] for r in ref]).clip(0.0)
    gain = t_interval([x["goodput_req_s"] - y["goodput_req_s"] for x, y in zip(mine, ref, strict=True)])
    tail = compare(ratio, 1.0 + WITHIN, claimed="below")
    more = compare(gain, 0.0, claimed="above")
    if tail == HELD and more == HELD:
        verdict = HELD
    elif NOT_HELD in (tail, more):
        verdict = NOT_HELD
    else:
        verdict = INCONCLUSIVE
    measured = f"TTFT p99 ratio {ratio.format(3)}; goodput {gain.format(3)} req/s"
    return Judged(verdict, measured)


# ---------------------------------------------------------------- the design against baselines


def comparison_judges(points: Sequence[Point], objectives: Sequence[Objective] = OBJECTIVES) -> dict:
    """(point label, design arm, baseline, objective metric) -> a judge of that one side
    (better / worse / tied at the current confidence level): the family the report's
    multiplicity correction adjusts with the claims."""
    judges: dict[Hashable, Callable[[], str]] = {}
    for point in points:
        for arm in point.design:
            for baseline in point.baselines:
                for objective in objectives:

                    def judge(p=point, a=arm, b=baseline, o=objective) -> str:
                        comparison = compare_arms(p.arms, a, b, (o,))
                        return "tied" if comparison is None else comparison.sides[0]

                    judges[(point.label, arm, baseline, objective.metric)] = judge
    return judges


# ---------------------------------------------------------------- which policy to use


@dataclass(frozen=True)
class Pick:
    arm: str
    why: str


def recommend(point: Point, held: Sequence[str]) -> Pick:
    """The regime's pick: of the deployable arms for which the headline claim held (`held`:
    within 10% of strict priority's top-class TTFT p99 with more goodput, judged by
    intervals after the report's multiplicity correction), the one with the most mean
    goodput; where it held for none, strict priority itself (`vllm_priority`, vLLM's own).
    The sentence gives what the pick rests on and what it gives up: the top class's SLO
    attainment beside strict priority's, and the arm with the most goodput when that one
    lets the top class wait longer."""
    ttft = f"sla{point.top()}_ttft_p99_s"
    attained = f"sla{point.top()}_slo_attainment"
    candidates = [a for a in held if a in point.deployable]
    arm = max(candidates, key=lambda a: point.mean(a, "goodput_req_s")) if candidates else STRICT_PRIORITY

    def numbers(a: str) -> str:
        goodput, tail, share = (point.mean(a, m) for m in ("goodput_req_s", ttft, attained))
        return f"goodput {goodput:.3g} req/s; top class: TTFT p99 {tail:.3g} s, SLO attainment {share:.3g}"

    if arm == STRICT_PRIORITY:
        why = f"{numbers(arm)}; no arm kept the top class within 10% of it with more goodput"
    else:
        why = (
            f"{numbers(arm)} (strict priority: {numbers(STRICT_PRIORITY)}); the claim held for "
            + ", ".join(f"`{a}`" for a in sorted(candidates))
        )
        comparison = compare_arms(point.arms, arm, STRICT_PRIORITY, (TOP_ATTAINMENT,))
        if comparison is not None and comparison.sides[0] == WORSE:
            why += (
                f"; but its top class meets its SLOs less often than under strict priority "
                f"(paired difference {comparison.diffs[0].format(3)})"
            )
    most = max(point.deployable, key=lambda a: point.mean(a, "goodput_req_s"))
    if point.mean(most, "goodput_req_s") > point.mean(arm, "goodput_req_s") and point.mean(most, ttft) > (
        1.0 + WITHIN
    ) * point.mean(STRICT_PRIORITY, ttft):
        why += f"; `{most}` has the most goodput ({numbers(most)})"
    return Pick(arm, why)


# ---------------------------------------------------------------- tables


def class_table(point: Point) -> str:
    """Every arm at the point, best goodput first: goodput, SLO attainment over all
    classes, then each class's SLO attainment, TTFT p99 and TPOT p99, top class first
    (means over seeds with 95% intervals)."""
    rows = [point.summary[a] for a in point.arms if a in point.summary]
    levels = sla_levels(rows)[::-1]
    columns = [("goodput_req_s", "goodput req/s"), ("slo_attainment", "SLO att. (all)")]
    for level in levels:
        columns += [
            (f"sla{level}_slo_attainment", f"L{level} att."),
            (f"sla{level}_ttft_p99_s", f"L{level} TTFT p99 s"),
            (f"sla{level}_tpot_p99_s", f"L{level} TPOT p99 s"),
        ]
    order = sorted(point.summary, key=lambda a: -point.mean(a, "goodput_req_s"))
    lines = [
        "| arm | " + " | ".join(title for _, title in columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for arm in order:
        if arm not in point.arms:
            continue
        name = f"`{arm}`" + (" (oracle)" if is_oracle(arm) else "")
        cells = [interval_cell(point.summary[arm], key) for key, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the section


def claimants(point: Point) -> list[str]:
    """The arms the headline claim is judged for: every deployable one but strict priority."""
    return [a for a in point.deployable if a != STRICT_PRIORITY]


def judges(points: Sequence[Point]) -> dict[Hashable, Callable[[], str]]:
    """Every verdict of the headline, as judges at the current confidence level: the
    headline claim per deployable arm (strict priority's own aside) and point, and each
    side of the design against each baseline (`comparison_judges`)."""
    out: dict[Hashable, Callable[[], str]] = {}
    for point in points:
        for arm in claimants(point):
            out[("claim", point.label, arm)] = lambda p=point, a=arm: (
                within_strict_priority(p.arms, a).verdict
            )
    out.update(comparison_judges(points))
    return out


def section(
    points: Sequence[Point],
    verdicts: Mapping[Hashable, str],
    how: str,
    source: str,
    per_verdict: Mapping[Hashable, str] | None = None,
) -> list[str]:
    """The page's opening: which policy per regime, the arms, the headline claim, the
    design against each baseline, every class per regime. `verdicts`: every judge of
    `judges` after the report's multiplicity correction (`per_verdict`: at 95% each, to
    say which the correction changed); `how`: that correction in words; `source`: where
    the runs are and how they were made."""
    per_verdict = per_verdict or verdicts
    design = list(points[0].design) if points else []
    arms = list(dict.fromkeys(a for p in points for a in [*p.baselines, *p.design] if a != STRICT_PRIORITY))
    lines = [
        "## Which policy should I use?",
        "",
        "Per regime of the headline comparison (below), the deployable policy to run: of the arms "
        "whose top class keeps within 10% of strict priority's TTFT p99 (`vllm_priority`, vLLM's "
        "own priority scheduling) with more goodput, judged by intervals ([the claim](#the-headline-claim-"
        "within-10-of-strict-prioritys-top-class-ttft-p99-with-more-goodput)), the one with the most "
        "goodput; where no arm does, strict priority. Arms named `*_oracle` know each request's true "
        "length and are never picked.",
        "",
        "| regime | use | why (means over seeds) |",
        "| --- | --- | --- |",
    ]
    for point in points:
        held = [a for a in claimants(point) if verdicts[("claim", point.label, a)] == HELD]
        pick = recommend(point, held)
        lines.append(f"| {point.label} | `{pick.arm}` | {pick.why} |")
    docs = {arm: doc for point in points for arm, doc in point.docs.items()}
    lines += ["", "The arms:", ""]
    lines += [f"- `{arm}`: {docs[arm]}" for arm in docs]
    lines += [
        "",
        "## The headline comparison",
        "",
        source,
        "",
        "How it is judged. Seeds of a point replay the same requests under every arm, so arms are "
        "compared by paired differences over seeds. One arm *dominates* another when it is better on "
        "at least one objective and worse on none, each side decided by the 95% interval of the "
        "paired difference lying wholly on one side of 0; the objectives are goodput, the top "
        "class's TTFT p99 and the top class's SLO attainment (experiments/dominance.py). A *trade* is "
        "better on one objective and worse on another. Multiplicity: " + how + ".",
        "",
        "Held out: the tuned arms (`score_tuned*`) were tuned on minutes of azure-conv "
        "(preempt/configs/tune.yaml), two of which fall in its first two windows here; azure-code "
        "never took part in the tuning, so judge them there (tests/experiments/test_tune.py checks "
        "both).",
        "",
        "### The headline claim: within 10% of strict priority's top-class TTFT p99, with more goodput",
        "",
        "Per arm and regime: held when Fieller's interval of the ratio of the top class's TTFT p99 "
        "(the arm over `vllm_priority`, paired means) lies below 1.1 and the paired interval of the "
        "goodput difference above 0; did not hold when either lies on the other side. The baselines "
        "first, then the design's variants.",
        "",
        "| arm | " + " | ".join(p.label for p in points) + " |",
        "| --- |" + " --- |" * len(points),
    ]
    for arm in arms:
        cells = []
        for point in points:
            if arm not in claimants(point):
                cells.append("–")
                continue
            judged = within_strict_priority(point.arms, arm)
            key = ("claim", point.label, arm)
            alone = f" ({per_verdict[key]} at 95% alone)" if per_verdict[key] != verdicts[key] else ""
            cells.append(f"**{verdicts[key]}**{alone}: {judged.measured}")
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### The design against each baseline",
        "",
        "Per regime, what each design arm's sides against each baseline add up to (after the "
        "multiplicity correction), as `dominates`, `dominated`, `trade` or `tied`; the count of "
        "regimes where it dominates / is dominated:",
        "",
    ]
    baselines = points[0].baselines if points else []
    lines += [
        "| design arm | " + " | ".join(f"`{b}`" for b in baselines) + " |",
        "| --- |" + " --- |" * len(baselines),
    ]
    for arm in design:
        cells = []
        for baseline in baselines:
            outcomes = [
                outcome([verdicts[(p.label, arm, baseline, o.metric)] for o in OBJECTIVES])
                for p in points
                if arm in p.design and baseline in p.baselines
            ]
            cells.append(f"{outcomes.count('dominates')} / {outcomes.count('dominated')} of {len(outcomes)}")
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    lines.append("")
    for point in points:
        lines += [f"### {point.label}", "", class_table(point), ""]
        lines += ["The design against each baseline here:", ""]
        lines += [
            "| design arm | " + " | ".join(f"`{b}`" for b in point.baselines) + " |",
            "| --- |" + " --- |" * len(point.baselines),
        ]
        for arm in point.design:
            cells = [
                outcome([verdicts[(point.label, arm, b, o.metric)] for o in OBJECTIVES])
                for b in point.baselines
            ]
            lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines
