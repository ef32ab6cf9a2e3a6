"""The report's multiplicity correction in its level form agrees with Benjamini-Hochberg
and Holm on p-values, leaves untested verdicts alone, and re-judges real intervals."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.multiplicity import adjust
from preempt.obs.stats import compare, confidence, confidence_level, t_interval


def _judge(p: float):
    """A verdict with p-value `p`: decisive exactly when the level's alpha is at least p."""
    return lambda: "held" if 1.0 - confidence_level() >= p - 1e-12 else "inconclusive"


def _bh(p: np.ndarray, alpha: float) -> set[int]:
    order = np.argsort(p)
    m = len(p)
    passing = [k for k in range(1, m + 1) if p[order[k - 1]] <= k * alpha / m]
    return set(order[: max(passing)].tolist()) if passing else set()


def _holm(p: np.ndarray, alpha: float) -> set[int]:
    order = np.argsort(p)
    m = len(p)
    out = set()
    for j, i in enumerate(order):
        if p[i] > alpha / (m - j):
            break
        out.add(int(i))
    return out


@pytest.mark.parametrize("method,reference", [("bh", _bh), ("holm", _holm)])
@pytest.mark.parametrize("seed", range(6))
def test_the_level_form_rejects_what_the_p_value_procedure_does(method, reference, seed):
    rng = np.random.default_rng(seed)
    # a mix of strong effects, borderline ones and nulls
    p = np.concatenate([rng.uniform(0, 1e-4, 8), rng.uniform(1e-3, 0.05, 12), rng.uniform(0, 1, 30)])
    adjusted = adjust({i: _judge(float(v)) for i, v in enumerate(p)}, method)
    assert adjusted.num_tests == len(p)
    kept = {i for i, v in adjusted.verdicts.items() if v == "held"}
    assert kept == reference(p, 0.05)
    assert set(adjusted.changed) == {i for i in range(len(p)) if p[i] <= 0.05} - kept


def test_untested_verdicts_stay_and_do_not_count():
    judges = {
        "a": _judge(0.001),
        "b": _judge(0.5),
        "idle": lambda: "idle",
        "nm": lambda: "not measured by this run",
    }
    adjusted = adjust(judges, "holm")
    assert adjusted.num_tests == 2
    assert adjusted.verdicts == {
        "a": "held",
        "b": "inconclusive",
        "idle": "idle",
        "nm": "not measured by this run",
    }
    none = adjust({"x": _judge(0.04), "y": _judge(0.04)}, "none")
    assert none.verdicts == {"x": "held", "y": "held"} and not none.changed


def test_a_side_that_loses_its_evidence_becomes_tied():
    adjusted = adjust({i: (lambda p=p: "better" if 1 - confidence_level() >= p else "tied") for i, p in
                       enumerate([0.04, 0.045, 0.9])}, "holm")  # fmt: skip
    assert adjusted.verdicts == {0: "tied", 1: "tied", 2: "tied"}
    assert adjusted.num_decisive == (2, 0)


def test_real_intervals_are_judged_again_at_the_stricter_level():
    # five seeds whose mean is clear of 0 at 95% but not at 99.9%
    values = [0.9, 1.6, 0.2, 1.1, 1.9]
    assert compare(t_interval(values), 0.0, claimed="above") == "held"
    with confidence(0.999):
        assert compare(t_interval(values), 0.0, claimed="above") is None
    assert confidence_level() == 0.95
    judges = {"x": lambda: compare(t_interval(values), 0.0, claimed="above") or "inconclusive"}
    judges.update({f"null{i}": (lambda: "inconclusive") for i in range(40)})
    adjusted = adjust(judges, "bh")
    assert adjusted.per_verdict["x"] == "held" and adjusted.verdicts["x"] == "inconclusive"
    assert adjusted.changed == ["x"]
    with pytest.raises(ValueError, match="multiplicity method"):
        adjust(judges, "bonferroni")
