"""The baselines added for the verdicts a reviewer asks for, on their own and in a replay:
`vllm_lcf` (vLLM's FCFS with RFC #54644's least-computed-first victim) and `uniboost`
(UniBoost's waiting order over SGLang's loop); and the design's class-strict variant
(`priority_score_class`: the SLA level first, the score within a level)."""

from __future__ import annotations

import math

import pytest

from preempt.core.config import PreemptionConfig, build_config
from preempt.core.request import RequestState
from preempt.core.workload import build_workload
from preempt.engine.engine import Engine
from preempt.engine.policies import ClassStrictScorePolicy, PriorityScorePolicy, UniBoostPolicy, get_policy
from tests.conftest import make_request


def _with_computed(request_id: int, computed: int):
    request = make_request(request_id, 64, 100)
    request.num_computed_tokens = computed
    return request


def test_lcf_takes_the_request_with_the_least_computed_last_admitted_on_ties():
    policy = get_policy("vllm_lcf", PreemptionConfig())
    running = [_with_computed(0, 300), _with_computed(1, 40), _with_computed(2, 90), _with_computed(3, 40)]
    assert policy.select_victim(running, 0.0) is running[3]  # 40 computed, admitted after request 1
    assert policy.select_victim(running[:3], 0.0) is running[1]


def test_lcf_admits_as_vllms_waiting_deque_a_victim_at_the_head():
    # vLLM appends an arrival and prepends a victim (`prepend_request`); an LCF victim may
    # have arrived after requests still waiting, and goes ahead of them all the same
    policy = get_policy("vllm_lcf", PreemptionConfig())
    first, second, late_victim, later_victim = (
        make_request(i, 64, 100, arrival_s=float(i)) for i in range(4)
    )
    for request in (first, second):
        policy.on_enqueue(request)
    for victim in (late_victim, later_victim):  # preempted in this order, each prepended
        victim.state = RequestState.PREEMPTED
        policy.on_enqueue(victim)
    order = sorted([first, second, late_victim, later_victim], key=policy.admission_key)
    assert order == [later_victim, late_victim, first, second]
    assert policy.arrival_key(make_request(9, 64, 100, arrival_s=0.0)) > policy.admission_key(second)


def test_the_uniboost_boost_is_gamma_boost_of_64_us_a_token():
    # boost(w) = -ln(1 - e^(-gamma w)) / gamma, gamma = 10/s, w = 64 µs x tokens
    for tokens in (1, 100, 512, 1000, 5000):
        work_s = 64e-6 * tokens
        assert UniBoostPolicy.boost_s(tokens) == pytest.approx(-math.log(1 - math.exp(-10 * work_s)) / 10)
    assert UniBoostPolicy.boost_s(1) == pytest.approx(0.7354, abs=1e-4)
    assert UniBoostPolicy.boost_s(1000) == pytest.approx(0.0749, abs=1e-4)
    assert UniBoostPolicy.boost_s(0) == 1e9  # nothing to compute: ahead of everyone


def test_uniboost_orders_by_entry_time_less_boost_and_a_requeued_request_enters_anew():
    policy = UniBoostPolicy(PreemptionConfig())
    long_early = make_request(0, 4000, 10, arrival_s=0.0)  # boost ~0.001 s
    short_late = make_request(1, 20, 10, arrival_s=0.3)  # boost ~0.9 s: ahead of it
    short_later = make_request(2, 20, 10, arrival_s=2.0)
    for request in (long_early, short_late, short_later):
        policy.on_enqueue(request)
    order = sorted([long_early, short_late, short_later], key=policy.admission_key)
    assert order == [short_late, long_early, short_later]
    # retracted at 5.0 s with 30 outputs: it enters at the step's end, with 50 tokens to redo
    policy.on_step([short_late], 0.01, 5.0)
    short_late.output_token_ids = [7] * 30
    policy.on_enqueue(short_late)
    assert policy.admission_key(short_late) == (5.0 - UniBoostPolicy.boost_s(50),)


def test_class_strict_puts_the_level_first_and_the_score_within_it():
    config = PreemptionConfig()
    strict, score = ClassStrictScorePolicy(config), PriorityScorePolicy(config)
    old_low = make_request(0, 64, 100, arrival_s=0.0, sla_level=0)  # waited 10 s
    new_top = make_request(1, 64, 100, arrival_s=10.0, sla_level=2)
    short_top = make_request(2, 64, 10, arrival_s=10.0, sla_level=2)
    waiting = [old_low, new_top, short_top]
    # the score lets 10 s of age outrank two levels; class-strict never does
    assert sorted(waiting, key=score.admission_key)[0] is old_low
    assert sorted(waiting, key=strict.admission_key) == [short_top, new_top, old_low]
    # victim: the lowest level, then the lowest score (the longest remaining work) in it
    long_low = make_request(3, 64, 900, arrival_s=10.0, sla_level=0)
    running = [new_top, old_low, long_low]
    assert strict.select_victim(running, 10.0) is long_low
    assert strict.select_victim([new_top, short_top], 10.0) is new_top


def test_class_strict_displaces_across_levels_only_upwards_and_by_the_margin_within():
    strict = ClassStrictScorePolicy(PreemptionConfig())
    top = make_request(0, 64, 100, arrival_s=0.0, sla_level=2)
    low = make_request(1, 64, 100, arrival_s=0.0, sla_level=0)
    assert strict.priority_victim(top, [low], 0.0) is low
    assert strict.priority_victim(low, [top], 100.0) is None  # however long it waited
    # within a level the score and its margin decide, as priority_score's
    twin = make_request(2, 64, 100, arrival_s=0.0, sla_level=2)
    assert strict.priority_victim(twin, [top], 0.0) is None  # equal scores: no margin
    much_older = make_request(3, 64, 100, arrival_s=-60.0, sla_level=2)
    assert strict.priority_victim(much_older, [top], 0.0) is top


@pytest.mark.parametrize("policy", ["vllm_lcf", "uniboost", "priority_score_class"])
def test_a_replay_under_pressure_finishes_every_request(policy):
    config = build_config(
        {
            "model": {"backend": "null"},
            "cache": {"block_size": 16, "num_blocks": 400},
            "scheduler": {"policy": policy},
            "workload": {"trace": "azure-conv", "duration_s": 30, "rate_scale": 4.0},
        }
    )
    engine = Engine(config)
    requests = build_workload(config.workload, seed=0)
    engine.run(requests)
    assert all(r.finish_s is not None for r in requests)
    if policy == "vllm_lcf":
        memory = [record for record in engine.scheduler.records if record.reason == "memory"]
        assert memory  # the pool ran out: LCF chose victims
