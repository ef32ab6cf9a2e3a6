"""The README's findings are the generated results page's numbers: each one is read from
its cell of docs/results.md (the headline's claim table, its "which policy" rows and
class tables, the quick point's claims), rounded as the page prints it, and must appear in
the README; and each verdict the README states is the page's. Regenerating the results
with other numbers, or editing a finding by hand, fails here until the two agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?)"
INTERVAL = rf"{NUMBER} \[{NUMBER}, {NUMBER}\]"
LOADED = [(trace, load) for trace in ("azure-conv", "azure-code") for load in ("2.0", "4.0")]


def _results() -> str:
    return (ROOT / "docs/results.md").read_text()


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())  # wrapped lines joined


def _section(title: str) -> str:
    """The body of docs/results.md's section `title` (up to the next heading)."""
    return _results().split(f"\n{title}\n", 1)[1].split("\n#", 1)[0]


def _point(trace: str, load: str) -> str:
    return f"trace={trace}, rate_scale={load}"


def _claim_cell(arm: str, trace: str, load: str) -> str:
    """The headline claim's cell of `arm` at the point."""
    table = _section(
        "### The headline claim: within 10% of strict priority's top-class TTFT p99, with more goodput"
    )
    lines = [line for line in table.splitlines() if line.startswith("|")]
    points = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    row = next(line for line in lines if line.startswith(f"| `{arm}` |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    return cells[points.index(_point(trace, load))]


def _interval(text: str, label: str) -> str:
    """`M [LO, HI]` after `label` in `text`, as printed."""
    found = re.search(re.escape(label) + rf" ({INTERVAL})", text)
    assert found, f"no '{label}' interval in {text!r}"
    return found.group(1)


def _pick(trace: str, load: str) -> tuple[str, str]:
    """(the arm, why) of the "which policy" row of the point."""
    row = next(
        line
        for line in _section("## Which policy should I use?").splitlines()
        if line.startswith(f"| {_point(trace, load)} |")
    )
    _, arm, why = (cell.strip() for cell in row.strip("|").split(" | ", 2))
    return arm.strip("`"), why


def _class_cell(trace: str, load: str, arm: str, column: str) -> str:
    """A cell of the point's every-class table."""
    table = _section(f"### {_point(trace, load)}")
    lines = [line for line in table.splitlines() if line.startswith("|")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| `{arm}` |"))
    return [cell.strip() for cell in row.strip("|").split("|")][head.index(column)]


def test_finding_one_the_class_first_tuned_score_at_every_loaded_point():
    readme = _readme()
    for trace, load in LOADED:
        assert _claim_cell("score_tuned_class", trace, load).startswith("**held**"), (trace, load)
    for trace, load in (("azure-conv", "2.0"), ("azure-code", "4.0")):
        cell = _claim_cell("score_tuned_class", trace, load)
        assert f"{_interval(cell, 'goodput')} req/s" in readme
        assert _interval(cell, "TTFT p99 ratio") in readme
    # what it gives up on the code trace: the top class's SLO attainment, and its TPOT
    arm, why = _pick("azure-code", "2.0")
    assert arm == "score_tuned_class"
    assert _interval(why, "paired difference") in readme
    mine = _class_cell("azure-code", "2.0", "score_tuned_class", "L2 TPOT p99 s").split()[0]
    strict = _class_cell("azure-code", "2.0", "vllm_priority", "L2 TPOT p99 s").split()[0]
    assert f"its TPOT p99 is {mine} s against strict priority's {strict} s" in readme
    # at the traces' own rate: strict priority
    assert all(_pick(trace, "1.0")[0] == "vllm_priority" for trace in ("azure-conv", "azure-code"))


@pytest.mark.parametrize(
    ("arm", "trace", "load", "label"),
    [
        ("score", "azure-code", "4.0", "goodput"),
        ("score", "azure-code", "4.0", "TTFT p99 ratio"),
        ("score_class", "azure-conv", "4.0", "TTFT p99 ratio"),
        ("score_class_nofallback", "azure-conv", "4.0", "TTFT p99 ratio"),
        ("uniboost", "azure-code", "4.0", "TTFT p99 ratio"),
        ("vllm_lcf", "azure-code", "4.0", "TTFT p99 ratio"),
    ],
)
def test_findings_two_and_three_quote_the_claim_table(arm, trace, load, label):
    assert _interval(_claim_cell(arm, trace, load), label) in _readme()


def test_finding_three_least_computed_first_recomputes_less_on_every_parity_workload():
    rows = re.findall(r"^\| ([\w-]+) \| (fcfs|lcf) \| identical \| \d+ \| \d+ \| ([\d,]+) \|$",
                      (ROOT / "docs/parity.md").read_text(), re.M)  # fmt: skip
    recomputed = {(workload, policy): int(tokens.replace(",", "")) for workload, policy, tokens in rows}
    workloads = {workload for workload, _ in recomputed}
    assert len(workloads) >= 7
    assert all(recomputed[(w, "lcf")] < recomputed[(w, "fcfs")] for w in workloads)
    assert "recompute fewer tokens than vLLM's FCFS on every bundled parity workload" in _readme()


def _quick_row(claim: str) -> str:
    """The row of `claim` in docs/results.md's "## Claims: quick"."""
    body = _results().split("\n## Claims: quick\n", 1)[1].split("\n## ", 1)[0]
    return next(line for line in body.splitlines() if line.startswith(f"| {claim}"))


def test_finding_four_quotes_the_stall_and_both_predictors():
    row = _quick_row("Predicting preemptions 50 ms ahead")
    readme = _readme()
    for label in ("swap_mixed stall", "early_lstm stall"):
        mean, lo, hi = (float(v) for v in re.search(re.escape(label) + rf" {INTERVAL}", row).groups())
        assert f"{mean:.3f} [{lo:.3f}, {hi:.3f}]" in readme, label
    for arm in ("early_lstm", "early_rule"):
        cut = re.search(rf"{arm} stall [^(]*\(({NUMBER}% \[{NUMBER}%, {NUMBER}%\])\)", row).group(1)
        assert cut in readme, arm
