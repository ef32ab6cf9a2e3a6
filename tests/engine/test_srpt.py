"""The length-aware baseline `srpt`, rule by rule as docs/srpt.md states them."""

from __future__ import annotations

from preempt.core.config import build_config
from preempt.engine.engine import Engine
from preempt.engine.policies import get_policy
from tests.conftest import make_request


def _policy(**preemption):
    config = build_config(
        {"model": {"backend": "null"}, "scheduler": {"policy": "srpt"}, "preemption": preemption}
    )
    return get_policy("srpt", config.preemption)


def _request(request_id, prompt, left, *, arrival_s=0.0, made=0):
    request = make_request(request_id, prompt, 1024, arrival_s=arrival_s)
    request.output_token_ids.extend([1] * made)
    request.num_computed_tokens = prompt + made
    request.expected_output_left = float(left)
    return request


def test_least_expected_remaining_work_is_admitted_first():
    policy = _policy()
    short, long = _request(0, 100, 50), _request(1, 100, 500)
    for r in (long, short):
        policy.on_enqueue(r)
    assert sorted([long, short], key=policy.admission_key) == [short, long]


def test_a_starving_request_goes_ahead_oldest_first():
    policy = _policy(srpt_starvation_s=5.0)
    old, older, short = (
        _request(0, 100, 900, arrival_s=1.0),
        _request(1, 100, 800),
        _request(2, 100, 10, arrival_s=2),
    )
    for r in (older, old, short):
        policy.on_enqueue(r)
    assert not policy.on_step([], 0.01, 4.0)  # nobody has waited 5 s yet
    assert policy.on_step([], 0.01, 6.5)  # older (since 0) and old (since 1) now starve
    assert sorted([short, old, older], key=policy.admission_key) == [older, old, short]


def test_running_again_ends_starvation():
    policy = _policy(srpt_starvation_s=1.0)
    request = _request(0, 100, 900)
    policy.on_enqueue(request)
    policy.on_step([], 0.01, 2.0)
    assert policy.admission_key(request)[0] == 0
    policy.on_step([request], 0.01, 2.1)
    policy.on_enqueue(request)  # preempted again later: joins as a fresh waiter
    assert policy.admission_key(request)[0] == 1


def test_preempts_the_longest_only_early_in_its_output_and_only_for_shorter_work():
    policy = _policy(srpt_preempt_below=0.5)
    early = _request(0, 100, 300, made=100)  # made 100 of ~400: a quarter
    late = _request(1, 100, 50, made=400)  # made 400 of ~450: not preemptible
    assert policy.priority_victim(_request(2, 100, 20), [early, late], 0.0) is early
    assert policy.priority_victim(_request(3, 100, 1000), [early, late], 0.0) is None  # longer work
    assert policy.priority_victim(_request(4, 100, 1), [late], 0.0) is None  # too late to preempt


def test_memory_victim_is_the_most_remaining_work():
    policy = _policy()
    a, b = _request(0, 100, 300), _request(1, 100, 900)
    assert policy.select_victim([a, b], 0.0) is b


def test_runs_in_the_engine_with_learned_lengths():
    config = build_config(
        {
            "model": {"backend": "null"},
            "cache": {"block_size": 16, "num_blocks": 200},
            "scheduler": {"policy": "srpt", "max_num_seqs": 4},
            "workload": {"trace": "azure-conv", "start_s": 600, "duration_s": 20, "max_tokens_mode": "fixed"},
            "preemption": {"remaining": "learned", "max_preemption_per_min": None},
        }
    )
    from preempt.core.workload import build_workload

    requests = build_workload(config.workload, seed=0)
    engine = Engine(config)
    engine.run(requests)
    assert all(r.state.is_final for r in requests)
    assert engine.stats()["num_preemptions"] > 0
