"""Declared claims: one judge for every `PairedTest`, and method text written from the
declaration (so the sentence a reader sees says what the judge does)."""

from __future__ import annotations

from typing import Any

import pytest

from experiments.claims import (
    CLAIMS,
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    PairedTest,
    claim_named,
    describe,
    design_claims,
    judge,
)


def _rows(arm: str, values: list[float], **extra: list[float]) -> list[dict[str, Any]]:
    return [
        {
            "arm": arm,
            "run": f"{arm}@seed={seed}",
            "status": "ok",
            "_config": {"seed": seed, "workload": {"sla_mix": {0: 0.9, 2: 0.1}}},
            "metric_s": value,
            **{k: v[seed] for k, v in extra.items()},
        }
        for seed, value in enumerate(values)
    ]


TEST = PairedTest("base", "new", "metric_s", "the metric", "the metric", "s", bound=0.0, side="below")


def test_judge_decides_by_the_side_of_the_paired_interval():
    base = _rows("base", [1.0, 2.0, 3.0, 4.0])
    assert judge(TEST, {"base": base, "new": _rows("new", [0.5, 1.4, 2.6, 3.5])}).verdict == HELD
    assert judge(TEST, {"base": base, "new": _rows("new", [1.5, 2.6, 3.4, 4.5])}).verdict == NOT_HELD
    assert judge(TEST, {"base": base, "new": _rows("new", [0.5, 2.5, 2.6, 4.5])}).verdict == INCONCLUSIVE
    assert judge(TEST, {"base": base}).verdict == NOT_MEASURED


def test_a_scaled_contrast_and_an_idle_rule():
    scaled = PairedTest("base", "new", "metric_s", "m", "m", "s", factor=2.0, idle=lambda b, a, k: None)
    base = _rows("base", [1.0, 2.0, 3.0])
    # new - 2 x base: 1.5 - 2, 3.5 - 4, 5.5 - 6 = -0.5 each seed: below 0
    finding = judge(scaled, {"base": base, "new": _rows("new", [1.5, 3.5, 5.5])})
    assert finding.verdict == HELD and "new - 2 x base -0.5" in finding.measured
    never = PairedTest("base", "new", "metric_s", "m", "m", "s", idle=lambda b, a, k: "it never acted")
    finding = judge(never, {"base": base, "new": _rows("new", [0.0, 0.0, 0.0])})
    assert finding.verdict == IDLE and finding.measured.endswith("; it never acted")


@pytest.mark.parametrize("side, other", [("below", "above"), ("above", "below")])
def test_method_text_is_written_from_the_declaration(side, other):
    test = PairedTest(
        "vllm_x", "mine", "m", "m", "the widget rate", "req/s", bound=0.25, side=side, factor=1.5
    )
    text = describe(test)
    for part in ("the widget rate", "`mine`", "1.5 x `vllm_x`", "in req/s", f"interval {side} 0.25 held"):
        assert part in text
    assert f"{other} did not hold" in text


def test_declared_claims_carry_their_declarations_method():
    priority = claim_named("priority")
    assert "`score` - `vllm_fcfs`" in priority.method and "interval below 0 held" in priority.method
    strict = design_claims("score")[1]
    assert "1.1 x `vllm_priority`" in strict.method
    with pytest.raises(KeyError, match="no claim 'nope'"):
        claim_named("nope")
    assert len({c.key for c in CLAIMS}) == len(CLAIMS)  # keys name one claim each
