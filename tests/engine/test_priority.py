"""The score's capped age term and which preemptions fill the rate cap's window."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.config import PriorityWeights
from preempt.engine.engine import Engine
from preempt.engine.priority import priority_score, priority_scores
from tests.conftest import make_request, small_config


def test_capped_age_never_lifts_a_request_over_a_level():
    weights = PriorityWeights(age=0.05, sla=0.8, tokens=0.0, age_cap_s=15.0)
    old_low = make_request(0, 10, 10, arrival_s=0.0, sla_level=0)
    new_high = make_request(1, 10, 10, arrival_s=999.0, sla_level=1)
    for now in (999.0, 1e4, 1e6):
        assert priority_score(new_high, now, weights) > priority_score(old_low, now, weights)
    # within a level age still orders, until the cap
    young = make_request(2, 10, 10, arrival_s=5.0)
    assert priority_score(old_low, 10.0, weights) > priority_score(young, 10.0, weights)
    assert priority_score(old_low, 100.0, weights) == priority_score(young, 100.0, weights)
    unbounded = PriorityWeights(age=0.05, sla=0.8, tokens=0.0)
    assert priority_score(old_low, 1e4, unbounded) > priority_score(new_high, 1e4, unbounded)


@pytest.mark.parametrize("cap", [None, 0.5])
def test_vector_scores_equal_scalar_ones(cap):
    weights = PriorityWeights(age=1.2, sla=0.8, tokens=0.5, age_cap_s=cap)
    requests = [make_request(i, 10 + i, 5 + i, arrival_s=0.1 * i, sla_level=i % 3) for i in range(8)]
    expected = [priority_score(r, 1.0, weights) for r in requests]
    np.testing.assert_allclose(priority_scores(requests, 1.0, weights), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cap", [None, 0.02])
def test_waiting_scores_follow_the_cap(cap):
    config = small_config(
        model={"backend": "null"},
        preemption={"priority_weights": {"age": 1.2, "sla": 0.8, "tokens": 0.5, "age_cap_s": cap}},
    )
    with Engine(config) as engine:
        for i in range(5):
            engine.scheduler.add_request(make_request(i, 10, 10, arrival_s=0.01 * i, sla_level=i % 2))
        waiting = engine.scheduler.waiting_requests()
        weights = config.preemption.priority_weights
        np.testing.assert_allclose(
            np.sort(engine.scheduler.waiting_scores(0.5)),
            np.sort([priority_score(r, 0.5, weights) for r in waiting]),
            rtol=0,
            atol=1e-12,
        )


def _run_rate_capped(counts: str):
    """Eight long low-class requests overflow the pool (memory preemptions from the start);
    three top-class ones arrive at 0.3 s, after two memory preemptions filled a cap of 2."""
    config = small_config(
        model={"backend": "null"},
        cache={"num_blocks": 64},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={
            "mode": "recompute",
            "max_preemption_per_min": 2,
            "rate_cap_counts": counts,
            "priority_weights": {"age": 0.0, "sla": 5.0, "tokens": 0.0},
        },
    )
    requests = [make_request(i, 60, 60, sla_level=0) for i in range(8)]
    requests += [make_request(100 + j, 8, 8, arrival_s=0.3 + 0.01 * j, sla_level=2) for j in range(3)]
    with Engine(config) as engine:
        engine.run(requests)
        records = [r for r in engine.scheduler.records if r.action != "none"]
    assert all(r.state.is_final for r in requests)
    return records, requests


def test_forced_preemptions_spend_the_cap_only_when_counted():
    counted, _ = _run_rate_capped("all")
    reasons = [r.reason for r in counted]
    assert reasons.count("memory") >= 2 and "priority" not in reasons  # the cap was full
    uncounted, _ = _run_rate_capped("priority")
    priority = [r for r in uncounted if r.reason == "priority"]
    assert priority  # the top class displaced someone although memory preemptions came first
    memory_before = [r for r in uncounted if r.reason == "memory" and r.time_s < priority[0].time_s]
    assert len(memory_before) >= 2
    # still a cap: never more than 2 priority preemptions in a minute
    assert len(priority) <= 2
