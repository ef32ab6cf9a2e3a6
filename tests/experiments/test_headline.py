"""The headline section's judgements on rows made to say one thing: the headline claim
(within 10% of strict priority's top-class TTFT p99 and more goodput), what sides add up
to, and the pick per regime (never an oracle arm)."""

from __future__ import annotations

import pytest

from experiments import headline
from experiments.dominance import outcome
from experiments.headline import Point, recommend, within_strict_priority


def _rows(arm: str, goodput: list[float], ttft: list[float], attainment: float = 0.9) -> list[dict]:
    return [
        {
            "arm": arm,
            "status": "ok",
            "_config": {"seed": seed},
            "goodput_req_s": g,
            "sla2_ttft_p99_s": t,
            "sla2_slo_attainment": attainment + 0.001 * seed,
            "sla0_ttft_p99_s": 5.0,
        }
        for seed, (g, t) in enumerate(zip(goodput, ttft, strict=True))
    ]


STRICT = _rows("vllm_priority", [5.0, 5.2, 4.9, 5.1, 5.0], [1.0, 1.1, 0.9, 1.05, 0.95])


def test_held_when_the_tail_is_within_10_percent_and_goodput_is_higher():
    arms = {
        "vllm_priority": STRICT,
        "score_x": _rows("score_x", [6.0, 6.1, 5.8, 6.2, 6.0], [1.0, 1.12, 0.9, 1.05, 0.96]),
    }
    assert within_strict_priority(arms, "score_x").verdict == "held"


@pytest.mark.parametrize(
    "goodput,ttft,verdict",
    [
        ([6.0, 6.1, 5.8, 6.2, 6.0], [9.0, 9.9, 8.1, 9.4, 8.6], "did not hold"),  # 9x the tail
        ([4.0, 4.1, 3.8, 4.2, 4.0], [1.0, 1.1, 0.9, 1.05, 0.95], "did not hold"),  # less goodput
        ([5.0, 5.5, 4.6, 5.2, 4.9], [1.0, 1.1, 0.9, 1.05, 0.95], "inconclusive"),  # goodput tied
    ],
)
def test_did_not_hold_or_inconclusive(goodput, ttft, verdict):
    arms = {"vllm_priority": STRICT, "score_x": _rows("score_x", goodput, ttft)}
    assert within_strict_priority(arms, "score_x").verdict == verdict


def test_without_strict_priority_it_is_not_measured():
    assert within_strict_priority({"score_x": STRICT}, "score_x").verdict == "not measured"


def test_sides_add_up():
    assert outcome(["better", "tied", "tied"]) == "dominates"
    assert outcome(["worse", "tied", "tied"]) == "dominated"
    assert outcome(["better", "worse", "tied"]) == "trade"
    assert outcome(["tied", "tied", "tied"]) == "tied"


def _point(arms: dict[str, list[dict]]) -> Point:
    summary = {}
    for name, rows in arms.items():
        keys = ("goodput_req_s", "sla2_ttft_p99_s", "sla2_slo_attainment")
        summary[name] = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return Point("trace=t, rate_scale=1.0", arms, summary, {name: "" for name in arms})


def test_the_pick_is_the_most_goodput_where_the_claim_held_else_strict_priority():
    arms = {
        "vllm_priority": STRICT,
        # most goodput, but its top class waits 8x longer
        "fastserve_mlfq": _rows("fastserve_mlfq", [9.0, 9.1, 8.9, 9.2, 9.0], [8.0, 8.2, 7.9, 8.1, 8.0], 0.5),
        "score_x": _rows("score_x", [6.0, 6.1, 5.8, 6.2, 6.0], [1.0, 1.12, 0.9, 1.05, 0.96]),
        "score_y": _rows("score_y", [5.5, 5.6, 5.3, 5.7, 5.5], [1.0, 1.12, 0.9, 1.05, 0.96]),
        "score_oracle": _rows("score_oracle", [20.0, 20.1, 19.8, 20.2, 20.0], [0.1, 0.1, 0.1, 0.1, 0.1], 1.0),
    }
    point = _point(arms)
    assert point.design == ["score_x", "score_y"] and point.baselines == ["vllm_priority", "fastserve_mlfq"]
    assert "score_oracle" not in headline.claimants(point)
    pick = recommend(point, ["score_y", "score_x", "score_oracle"])
    assert pick.arm == "score_x"
    assert "the claim held for `score_x`, `score_y`" in pick.why
    assert "`fastserve_mlfq` has the most goodput" in pick.why
    # its top class meets its SLOs less often (0.9 + 0.001 x seed against 0.9 + ...: tied here)
    assert "less often" not in pick.why
    # a pick whose top class meets its SLOs less often says so
    arms["score_z"] = _rows("score_z", [7.0, 7.1, 6.8, 7.2, 7.0], [1.0, 1.12, 0.9, 1.05, 0.96], 0.5)
    worse = recommend(_point(arms), ["score_x", "score_z"])
    assert worse.arm == "score_z" and "meets its SLOs less often than under strict priority" in worse.why
    assert recommend(point, []).arm == "vllm_priority"
    assert recommend(point, ["score_oracle"]).arm == "vllm_priority"  # never an oracle


def test_every_judge_is_keyed_by_point_arm_baseline_and_objective():
    point = _point({"vllm_priority": STRICT, "score_x": _rows("score_x", [6.0] * 5, [1.0] * 5)})
    judges = headline.judges([point])
    assert set(judges) == {("claim", point.label, "score_x")} | {
        (point.label, "score_x", "vllm_priority", metric)
        for metric in ("goodput_req_s", "sla{top}_ttft_p99_s", "sla{top}_slo_attainment")
    }
    assert judges[(point.label, "score_x", "vllm_priority", "goodput_req_s")]() == "better"
