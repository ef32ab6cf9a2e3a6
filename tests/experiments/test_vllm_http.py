"""The HTTP bench's summary on made-up server results (the servers: tests/integrations)."""

from __future__ import annotations

import pytest

from experiments.vllm_http import summarize_http


def _result(name: str, tops: list[float], tokens: list[int]) -> dict:
    runs = [
        {
            "wall_s": 5.0 + k,
            "ttft_s": {"priority_0": top, "priority_3": 2.0},
            "requests": [{"id": 1, "token_ids": tokens}, {"id": 2, "token_ids": [7]}],
        }
        for k, top in enumerate(tops)
    ]
    return {"name": name, "runs": runs, "metrics": {"vllm:num_preemptions_total": 3.0}, "exit_code": 0}


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
