"""Dominance from paired intervals, and the leaderboard built on it."""

from __future__ import annotations

import math
from typing import Any

from experiments.dominance import BETTER, OBJECTIVES, TIED, WORSE, compare_arms, dominators, paired
from experiments.leaderboard import best_by_interval, pareto_plot, point_tables, rank, where_to_run


def _arm(name: str, goodput: list[float], ttft: list[float], seeds: list[int] | None = None) -> list[dict]:
    seeds = seeds or list(range(len(goodput)))
    return [
        {
            "arm": name,
            "run": f"{name}@seed={seed}",
            "status": "ok",
            "_config": {"seed": seed},
            "goodput_req_s": g,
            "sla0_ttft_p99_s": t * 3,
            "sla2_ttft_p99_s": t,
            "sla2_slo_attainment": 0.9,  # the same everywhere: a tie unless a test says otherwise
        }
        for seed, g, t in zip(seeds, goodput, ttft, strict=True)
    ]


def _summary(arms: dict[str, list[dict]]) -> list[dict[str, Any]]:
    rows = []
    for name, runs in arms.items():
        row: dict[str, Any] = {"arm": name, "num_seeds": len(runs)}
        for key in ("goodput_req_s", "sla2_ttft_p99_s", "sla0_ttft_p99_s", "sla2_slo_attainment"):
            values = [r[key] for r in runs]
            row[key] = sum(values) / len(values)
            row[f"{key}_lo"], row[f"{key}_hi"] = min(values), max(values)
        rows.append(row)
    return rows


ARMS = {
    "a": _arm("a", [5.0, 5.2, 5.1], [1.0, 1.1, 0.9]),
    "b": _arm("b", [4.0, 4.1, 4.2], [2.0, 2.2, 1.9]),  # worse on both than a
    "c": _arm("c", [3.0, 3.1, 3.2], [0.5, 0.6, 0.4]),  # better TTFT, worse goodput than a
}


def test_pairs_only_the_seeds_every_arm_ran():
    arms = {"a": ARMS["a"], "late": _arm("late", [1.0, 2.0], [1.0, 1.0], seeds=[1, 2])}
    a, late = paired(arms, "a", "late")
    assert [r["_config"]["seed"] for r in a] == [1, 2] == [r["_config"]["seed"] for r in late]
    assert paired(arms, "a", "missing") is None


def test_sides_follow_each_objectives_direction():
    comparison = compare_arms(ARMS, "a", "b")
    assert comparison.sides == (BETTER, BETTER, TIED) and comparison.dominates
    comparison = compare_arms(ARMS, "c", "a")
    assert comparison.sides == (WORSE, BETTER, TIED) and not comparison.dominates and not comparison.dominated


def test_the_top_class_attainment_can_save_an_arm_from_dominance():
    # fast admits the top class sooner (TTFT) but misses its SLO more (TPOT): not dominant.
    fast = [{**r, "sla2_slo_attainment": 0.5} for r in _arm("fast", [5.0, 5.2, 5.1], [0.5, 0.6, 0.4])]
    arms = {"a": ARMS["a"], "fast": fast}
    assert compare_arms(arms, "fast", "a").sides == (TIED, BETTER, WORSE)
    assert dominators(arms, ["a", "fast"]) == {"a": [], "fast": []}


def test_the_front_is_who_nobody_dominates():
    assert dominators(ARMS, list(ARMS)) == {"a": [], "b": ["a"], "c": []}


def test_noise_is_a_tie_not_a_win():
    noisy = {"a": ARMS["a"], "n": _arm("n", [3.0, 7.0, 5.5], [0.2, 2.0, 1.0])}
    assert compare_arms(noisy, "n", "a").sides == (TIED, TIED, TIED)
    assert dominators(noisy, ["a", "n"]) == {"a": [], "n": []}


def test_best_by_interval_lists_the_ties():
    goodput, ttft, _ = OBJECTIVES
    assert best_by_interval(ARMS, goodput) == ["a"]
    tied = {**ARMS, "a2": _arm("a2", [5.3, 4.9, 5.0], [1.0, 1.0, 1.0])}
    assert best_by_interval(tied, goodput) == ["a", "a2"]
    assert best_by_interval(ARMS, ttft)[0] == "c"


def test_where_to_run_and_the_point_tables(tmp_path):
    table = where_to_run([("point", ARMS)], design_arms=("b",))
    assert "| point | `a`, `c` | `a` | `c` |" in table and "(worse)" in table
    text = point_tables(rank(ARMS, _summary(ARMS)))
    assert "**front**" in text and "| `b` |" in text and "`a`" in text.split("| `b` |")[1].split("\n")[0]
    path = pareto_plot(rank(ARMS, _summary(ARMS)), tmp_path / "pareto.png", "point")
    assert path.is_file() and path.stat().st_size > 1000
    assert pareto_plot(rank(ARMS, None), tmp_path / "none.png", "point") is None


def test_a_missing_value_is_not_a_difference():
    arms = {"a": ARMS["a"], "gap": _arm("gap", [4.0, 4.1, 4.2], [math.nan, math.nan, math.nan])}
    comparison = compare_arms(arms, "a", "gap")
    assert comparison.sides[1] == TIED and not comparison.diffs[1].is_defined


def test_arms_on_their_own_workload_are_left_out_of_the_comparison():
    from experiments.dominance import comparable

    def on(rows: list[dict], **config) -> list[dict]:
        return [{**r, "_config": {**r["_config"], **config}} for r in rows]

    quick = {"workload": {"duration_s": 60}, "cache": {"num_blocks": 1000}}
    arms = {
        "a": on(ARMS["a"], **quick, scheduler={"max_num_seqs": 16, "policy": "vllm_fcfs"}),
        "b": on(ARMS["b"], **quick, scheduler={"max_num_seqs": 16, "policy": "priority_score"}),
        "tiny": on(ARMS["c"], workload={"duration_s": 30}, cache={"num_blocks": 300}),
    }
    assert list(comparable(arms)) == ["a", "b"]  # the policy may differ; the requests may not
    assert "tiny" not in where_to_run([("point", arms)], design_arms=("b",))
