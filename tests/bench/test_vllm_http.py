"""The HTTP bench's summary on made-up server results (the servers: tests/integrations)."""

from __future__ import annotations

import pytest

from preempt.bench.vllm_http import summarize_http


def _result(name: str, tops: list[float], tokens: list[int]) -> dict:
    runs = [
        {
            "wall_s": 5.0 + k,
            "ttft_s": {"priority_0": top, "priority_3": 2.0},
            "requests": [{"id": 1, "token_ids": tokens}, {"id": 2, "token_ids": [7]}],
            "metrics": {"vllm:num_preemptions_total": 1.0},
        }
        for k, top in enumerate(tops)
    ]
    return {"name": name, "runs": runs, "metrics": {"vllm:num_preemptions_total": 4.0}, "exit_code": 0}


def test_summary_pairs_by_seed_and_names_the_best_arm():
    results = [
        _result("vllm_fcfs", [1.0, 1.2, 1.1], [5, 6]),
        _result("vllm_priority", [0.5, 0.7, 0.6], [5, 6]),
        _result("plugin", [0.2, 0.5, 0.3], [5, 9]),  # one request's tokens differ
    ]
    summary = summarize_http(results)
    assert summary["best_for_top_class"] == "plugin"
    plugin = summary["arms"]["plugin"]
    assert plugin["ttft_top_s"]["mean"] == pytest.approx(1.0 / 3)
    diff = plugin["ttft_top_minus_vllm_priority_s"]
    assert diff["mean"] == pytest.approx(-0.2667, abs=1e-3) and diff["hi"] < 0  # paired: tight
    assert plugin["outputs_equal_vllm_fcfs"] == "3/6"
    assert summary["arms"]["vllm_priority"]["outputs_equal_vllm_fcfs"] == "6/6"
    assert "ttft_top_minus_vllm_priority_s" not in summary["arms"]["vllm_priority"]
    # the counters of these runs (3 seeds x 1), not the server's over warm-up and other shapes
    assert plugin["preemptions"] == 3.0


def test_summary_gives_the_top_class_ratio_to_vllm_priority():
    results = [
        _result("vllm_fcfs", [1.0, 1.2, 1.1], [5, 6]),
        _result("vllm_priority", [0.5, 0.7, 0.6], [5, 6]),
        _result("plugin", [0.2, 0.5, 0.3], [5, 6]),
    ]
    summary = summarize_http(results)
    assert list(summary["arms"]) == ["vllm_fcfs", "vllm_priority", "plugin"]  # the arms' order
    assert summary["plugin_over_vllm_priority"] == pytest.approx((1.0 / 3) / 0.6, abs=1e-3)
    assert summary["arms"]["plugin"]["ttft_top_over_vllm_priority_per_seed"] == [0.4, 0.714, 0.5]
    assert summary["arms"]["vllm_fcfs"]["ttft_top_over_vllm_priority"] == pytest.approx(1.833, abs=1e-3)


def test_priority_shape_keeps_the_pool_busy_while_the_urgent_class_trickles_in():
    from preempt.bench.vllm_http import http_workload

    mixed = http_workload(60, 20, seed=3)
    shaped = http_workload(60, 20, seed=3, shape="priority")
    assert [r.prompt for r in mixed] == [r.prompt for r in shaped]  # same prompts, other times
    low = [r for r in shaped if r.priority == 3]
    high = [r for r in shaped if r.priority == 0]
    assert {r.max_tokens for r in low} == {200} and {r.max_tokens for r in high} == {16}
    assert high[0].at_s == 3.0 and high[1].at_s == pytest.approx(3.4)
    assert {len(r.prompt) for r in low} == {96} and {len(r.prompt) for r in high} == {64}
    assert mixed[60].at_s == pytest.approx(1.2) and {r.max_tokens for r in mixed[:60]} == {48}
