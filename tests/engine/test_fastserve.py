"""FastServe's skip-join MLFQ (`fastserve_mlfq`), rule by rule as docs/fastserve.md cites
them from its artifact (LLMServe/FastServe fastserve/scheduler.py, FS:line)."""

from __future__ import annotations

import pytest

from experiments.plan import chain_overrides
from preempt.core.config import build_config
from preempt.core.request import RequestState
from preempt.engine.engine import Engine
from preempt.engine.policies import get_policy
from tests.conftest import make_request


def _config(**mlfq):
    return build_config(
        {
            "model": {"backend": "null", "max_model_len": 8192},
            "cache": {"block_size": 16, "num_blocks": 4096},
            "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 2048, "policy": "fastserve_mlfq"},
            "preemption": {"mode": "pause", "max_preemption_per_min": None, "mlfq": mlfq},
        }
    )


def _policy(**mlfq):
    return get_policy("fastserve_mlfq", _config(**mlfq).preemption)


def test_quanta_double_from_10_ms():  # FS:419-421, 494-512
    policy = _policy()
    assert [policy.quantum_s(k) for k in range(4)] == pytest.approx([0.01, 0.02, 0.04, 0.08])


@pytest.mark.parametrize(
    "prompt, level",
    [(200, 0), (400, 0), (401, 1), (800, 1), (801, 2), (4000, 4)],  # 40 tokens per ms of prefill
)
def test_skip_join_picks_the_first_queue_whose_quantum_covers_the_prefill(prompt, level):  # FS:471-481
    assert _policy().join_level(make_request(0, prompt, 10)) == level


def test_skip_join_stops_at_the_last_queue_when_levels_are_capped():
    assert _policy(num_levels=3).join_level(make_request(0, 40_000, 10)) == 2


def test_demotion_one_queue_when_time_at_the_level_exceeds_its_quantum_then_time_restarts():  # FS:494-512
    policy = _policy()
    request = make_request(0, 100, 100)
    policy.on_enqueue(request)
    policy.on_step([request], 0.006, 0.006)
    assert policy.level(request) == 0  # 6 ms <= 10 ms
    policy.on_step([request], 0.004, 0.010)
    assert policy.level(request) == 0  # exactly the quantum: not above it
    policy.on_step([request], 0.001, 0.011)
    assert policy.level(request) == 1  # 11 ms > 10 ms
    policy.on_step([request], 0.015, 0.026)
    assert policy.level(request) == 1  # the clock restarted at level 1: 15 <= 20 ms
    policy.on_step([request], 1.0, 1.026)
    assert policy.level(request) == 2  # one queue per iteration, however long it was


def test_new_requests_queue_at_the_back_preempted_ones_at_the_front():  # FS:478, 510, 552
    policy = _policy()
    first, second, third = (make_request(i, 100, 100, arrival_s=0.001 * i) for i in range(3))
    for request in (first, second, third):
        policy.on_enqueue(request)
    assert sorted([third, first, second], key=policy.admission_key) == [first, second, third]
    policy.on_step([third], 0.001, 0.004)  # it ran (admitted), then is taken out again
    policy.on_enqueue(third)
    assert sorted([first, second, third], key=policy.admission_key) == [third, first, second]


def test_starvation_moves_long_waiters_to_the_front_of_the_top_queue():  # FS:561-564, 595-617
    policy = _policy(starvation_every_steps=3, starvation_s=0.5)
    runner = make_request(0, 100, 100)
    starved = make_request(1, 4000, 100, arrival_s=0.0)  # joins queue 4
    fresh = make_request(2, 4000, 100, arrival_s=0.9)
    for request in (runner, starved, fresh):
        policy.on_enqueue(request)
    assert policy.level(starved) == 4
    assert not policy.on_step([runner], 0.001, 0.4)
    assert not policy.on_step([runner], 0.001, 1.0)  # not a check step
    assert policy.on_step([runner], 0.001, 1.0) == [starved]  # third step: the check
    assert policy.level(starved) == 0 and policy.level(fresh) == 4  # 1.0 s vs 0.1 s waited
    assert policy.admission_key(starved) < policy.admission_key(runner)


def test_victims_are_the_lowest_queue_latest_in_it_and_only_a_higher_queue_displaces():  # FS:656-690
    policy = _policy()
    a, b, c = (make_request(i, 4000 if i else 100, 100, arrival_s=0.001 * i) for i in range(3))
    for request in (a, b, c):
        policy.on_enqueue(request)
    assert policy.select_victim([a, b, c], 0.0) is c  # queue 4, behind b
    assert policy.priority_victim(a, [b, c], 0.0) is c  # queue 0 displaces queue 4
    assert policy.priority_victim(b, [c], 0.0) is None  # same queue: no preemption


def _first_tokens(**mlfq):
    engine = Engine(_config(**mlfq))
    long = [make_request(i, 30, 400, arrival_s=0.0) for i in range(2)]  # both seats, demoted
    starved = make_request(2, 4000, 5, arrival_s=0.0)  # queue 4
    late = make_request(3, 2000, 5, arrival_s=0.0)  # queue 3: ahead of it without starvation
    engine.run([*long, starved, late])
    assert all(r.state is RequestState.FINISHED for r in (*long, starved, late))
    return starved.first_token_s, late.first_token_s


def test_the_scheduler_resorts_its_queue_when_starvation_promotes():
    starved, late = _first_tokens()  # no check within the run
    assert late < starved
    # Both promoted; the one collected last (the lower queue's) is at the very front.
    starved, late = _first_tokens(starvation_every_steps=2, starvation_s=0.01)
    assert starved < late


def test_a_new_short_request_preempts_a_demoted_long_one():
    engine = Engine(_config())
    first = [make_request(0, 100, 2000), make_request(1, 120, 2000)]  # fill both seats, run long
    late = make_request(2, 50, 5, arrival_s=1.0)  # joins queue 0 while the others are demoted
    engine.run(first + [late])
    priority = [r for r in engine.scheduler.records if r.reason == "priority"]
    assert priority and priority[0].challenger_id == 2
    assert late.first_token_s - late.arrival_s < 0.1  # it did not wait for a seat to free up


def test_the_arm_keeps_kv_on_the_gpu_until_needed_and_swaps_raw_ahead():
    overrides = dict(chain_overrides("fastserve_mlfq"))
    assert overrides["preemption.mode"] == "pause"
    assert overrides["preemption.reclaim_codec"] == "raw"
    assert overrides["preemption.async_restore"] is True
    assert overrides["early_save.prefetch"] is True
