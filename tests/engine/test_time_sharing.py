"""Slices that decide: time sharing (`preemption.slice_mode: quantum`), and FastServe's
skip-join MLFQ reproducible like it (its rules: test_fastserve.py), on the null backend
and the virtual clock."""

from __future__ import annotations

import pytest

from preempt.core.config import build_config
from preempt.core.request import RequestState
from preempt.engine.engine import Engine
from tests.conftest import make_request


def _config(policy: str = "priority_score", **preemption):
    return build_config(
        {
            "model": {"backend": "null", "max_model_len": 8192},
            "cache": {"block_size": 16, "num_blocks": 4096},
            "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 2048, "policy": policy},
            "preemption": {"mode": "pause", "max_preemption_per_min": None, **preemption},
        }
    )


def _requests():
    # More requests than seats, all of one SLA level, long and short mixed: who runs is up
    # to the slices alone.
    lengths = [(600, 300), (40, 300), (700, 250), (30, 280), (650, 260), (50, 240)]
    return [make_request(i, p, o, arrival_s=0.001 * i) for i, (p, o) in enumerate(lengths)]


def _run(config):
    engine = Engine(config)
    requests = _requests()
    engine.run(requests)
    assert all(r.state is RequestState.FINISHED for r in requests)
    return engine, requests


def _schedule(engine):
    return [(r.time_s, r.request_id, r.challenger_id) for r in engine.scheduler.records]


def test_a_used_slice_yields_its_seat_in_quantum_mode_only():
    gate, _ = _run(_config(slice_mode="gate", time_slice_strategy="static"))
    quantum, requests = _run(_config(slice_mode="quantum", time_slice_strategy="static"))
    # Same SLA level, no score margin beaten: gating alone never preempts; time sharing does,
    # and each request still ran at least a slice before yielding.
    assert gate.scheduler.num_preemptions == 0
    assert quantum.scheduler.num_preemptions > 10
    assert all(r.slice_used_s >= r.slice_s for r in quantum.scheduler.records if r.reason == "priority")


def test_static_and_dynamic_slices_make_different_schedules():
    static, _ = _run(_config(slice_mode="quantum", time_slice_strategy="static"))
    dynamic, _ = _run(_config(slice_mode="quantum", time_slice_strategy="dynamic"))
    assert _schedule(static) != _schedule(dynamic)
    # Dynamic gives long requests (>512 tokens) 50 ms and short ones 10 ms; static 20 ms to all.
    slices = {r.slice_s for r in dynamic.scheduler.records}
    assert {0.05, 0.01} <= slices
    assert {r.slice_s for r in static.scheduler.records} == {0.02}


def test_quantum_never_lets_a_lower_level_take_a_higher_ones_seat():
    engine = Engine(_config(slice_mode="quantum", time_slice_strategy="static"))
    requests = _requests()
    for r in requests[:2]:
        r.sla_level = 1  # the two that get the seats first
    engine.run(requests)
    displaced = {r.request_id for r in engine.scheduler.records if r.reason == "priority"}
    assert not displaced & {0, 1}


@pytest.mark.parametrize("policy", ["fastserve_mlfq", "priority_score"])
def test_reproducible(policy):
    extra = {"slice_mode": "quantum"} if policy == "priority_score" else {}
    a, _ = _run(_config(policy, **extra))
    b, _ = _run(_config(policy, **extra))
    assert _schedule(a) == _schedule(b)
