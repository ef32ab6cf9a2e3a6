"""The comparison can fail: every kind of difference is found at its step."""

from __future__ import annotations

import copy

from preempt.parity.compare import compare_traces, totals

TRACE = [
    {"scheduled": {"0": [0, 8], "1": [0, 8]}, "preempted": [], "finished": []},
    {"scheduled": {"0": [8, 1]}, "preempted": ["1"], "finished": []},
    {"scheduled": {"0": [9, 1]}, "preempted": [], "finished": ["0"]},
    {"scheduled": {"1": [0, 9]}, "preempted": [], "finished": ["1"]},
]


def test_identical_traces_and_totals():
    report = compare_traces(TRACE, copy.deepcopy(TRACE))
    assert report["identical"] and report["first_divergence"] is None
    assert report["steps_agreeing"] == 4
    # request 1 computed 8 tokens, was preempted, and recomputed them (plus its output)
    assert totals(TRACE) == {"steps": 4, "preemptions": 1, "scheduled_tokens": 27, "recomputed_tokens": 8}


def test_each_kind_of_difference_is_reported_at_its_step():
    cases = [
        (1, "scheduled", lambda t: t[1]["scheduled"].update({"0": [8, 2]})),  # other token count
        (0, "scheduled", lambda t: t[0]["scheduled"].update({"1": [1, 8]})),  # other start
        (1, "preempted", lambda t: t[1]["preempted"].append("0")),
        (2, "finished", lambda t: t[2]["finished"].clear()),
    ]
    for step, field, change in cases:
        ours = copy.deepcopy(TRACE)
        change(ours)
        report = compare_traces(TRACE, ours)
        assert not report["identical"]
        assert report["first_divergence"]["step"] == step and report["first_divergence"]["field"] == field


def test_a_shorter_run_differs():
    report = compare_traces(TRACE, copy.deepcopy(TRACE[:3]))
    assert not report["identical"]
    assert report["first_divergence"]["step"] == 3
