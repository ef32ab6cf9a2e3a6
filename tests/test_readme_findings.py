"""The README's findings are the generated results page's numbers: each one is read from
its cell of docs/results.md (the section and claim it names), rounded as the README
prints it, and must appear in the README. Regenerating the results with other numbers,
or editing a finding by hand, fails here until the two agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(-?[0-9.]+(?:e-?[0-9]+)?)"


def _row(section: str, claim: str) -> str:
    """The row of `claim` in docs/results.md's "## Claims: `section`"."""
    text = (ROOT / "docs/results.md").read_text()
    body = text.split(f"\n## Claims: {section}\n", 1)[1].split("\n## ", 1)[0]
    return next(line for line in body.splitlines() if line.startswith(f"| {claim}"))


def _interval(row: str, label: str, unit: str = "") -> tuple[float, float, float]:
    """The `label M [LO, HI]` interval in `row` (`unit` after the numbers, as `%`)."""
    found = re.search(
        re.escape(label) + rf" {NUMBER}{unit} \[{NUMBER}{unit}, {NUMBER}{unit}\]",
        row,
    )
    assert found, f"no '{label}' interval in the row"
    mean, lo, hi = (float(value) for value in found.groups())
    return mean, lo, hi


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())  # wrapped lines joined


DOMINATED = "`{}` is not dominated by any named baseline"


@pytest.mark.parametrize(
    ("section", "arm", "label", "flip", "digits"),
    [
        # finding 1: at quick, strict priority over the score (cap) on top-class attainment
        ("quick", "score", "vllm_priority - score: goodput req/s", None, None),
        # ... and the learned score's goodput over strict priority (the sign flipped)
        ("quick", "score_learned", "vllm_priority - score_learned: goodput req/s", -1, 2),
    ],
)
def test_finding_one_quotes_the_quick_points_cells(section, arm, label, flip, digits):
    row = _row(section, DOMINATED.format(arm))
    readme = _readme()
    if flip is None:  # the score's row: strict priority's top-class attainment lead
        mean, lo, hi = _interval(row.split(label, 1)[1], "top class SLO attainment")
        assert f"+{mean:.3f} [{lo:.3f}, {hi:.3f}]" in readme
        return
    mean, lo, hi = (flip * value for value in _interval(row, label))
    lo, hi = min(lo, hi), max(lo, hi)
    assert f"+{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]" in readme


def test_finding_one_names_the_load_point_where_strict_priority_dominates():
    row = _row("load (rate_scale=2.0)", DOMINATED.format("score_learned"))
    part = row.split("vllm_priority - score_learned:", 1)[1].split(";", 1)[0]
    assert "(dominates it)" in part
    mean, lo, hi = _interval(part, "top class SLO attainment")
    assert f"+{mean:.3f} [{lo:.3f}, {hi:.3f}]" in _readme()
    tail = _row("quick", "`score_learned` protects the top class")
    strict, learned = re.search(rf"TTFT p99 {NUMBER} \[.*?\(vllm_priority\) -> {NUMBER} \[", tail).groups()
    assert f"{float(learned):.1f} s against strict priority's {float(strict):.2f} s" in _readme()


def test_finding_three_quotes_the_stall_and_both_predictors():
    row = _row("quick", "Predicting preemptions 50 ms ahead")
    readme = _readme()
    for label in ("swap_mixed stall", "early_lstm stall"):
        mean, lo, hi = _interval(row, label)
        assert f"{mean:.3f} [{lo:.3f}, {hi:.3f}]" in readme, label
    for arm in ("early_lstm", "early_rule"):
        cut = re.search(rf"{arm} stall [^(]*\(({NUMBER}% \[{NUMBER}%, {NUMBER}%\])\)", row).group(1)
        assert cut in readme, arm
