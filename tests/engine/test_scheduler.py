"""Scheduler decisions, driven directly (no model): budgets, chunked prefill, victims."""

from __future__ import annotations

from preempt.core.block_pool import BlockPool
from preempt.core.config import SchedulerConfig
from preempt.core.request import RequestState
from preempt.engine.policies import get_policy
from preempt.engine.scheduler import Scheduler
from tests.conftest import make_request


def make_scheduler(num_blocks=64, block_size=4, policy="vllm_fcfs", **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 32, **cfg})
    return Scheduler(config, get_policy(policy), BlockPool(num_blocks), block_size)


def complete(scheduler: Scheduler, output) -> list:
    """The engine's update after a step, through the real `update_from_output`: the
    runner's token 7 for each chunk that reaches the end of its known tokens."""
    tokens = [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in output.chunks]
    return scheduler.update_from_output(output, 0.0, tokens, now=0.0)


def test_chunked_prefill_respects_token_budget():
    scheduler = make_scheduler()
    long = make_request(0, 50, 3)
    scheduler.add_request(long)
    out = scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.chunks] == [(0, 32)]
    complete(scheduler, out)
    out = scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.chunks] == [(0, 18)]
    assert len(long.block_ids) == 13  # ceil(50 / 4)


def test_max_num_seqs_and_fcfs_admission_order():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(i, 4, 3, arrival_s=float(i)))
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.chunks] == [0, 1]
    assert [r.request_id for r in scheduler.waiting_requests()] == [2, 3]


def test_priority_policy_admits_vip_first():
    scheduler = make_scheduler(policy="vllm_priority", max_num_seqs=1)
    scheduler.add_request(make_request(0, 4, 3, arrival_s=0.0, sla_level=0))
    scheduler.add_request(make_request(1, 4, 3, arrival_s=1.0, sla_level=1))
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.chunks] == [1]


def test_recompute_preemption_of_last_admitted_then_resume():
    # 4 blocks of 4 tokens. Two 8-token prompts fill the pool; the first decode needs a
    # third block, so vllm_fcfs preempts the last admitted, which resumes from scratch
    # (prompt + its one output recomputed) once the first one finishes.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    first, second = make_request(0, 8, 4, arrival_s=0.0), make_request(1, 8, 4, arrival_s=1.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    complete(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert out.preempted == [second] and [(r.request_id, n) for r, n in out.chunks] == [(0, 1)]
    assert (
        second.state is RequestState.PREEMPTED and second.block_ids == [] and second.num_computed_tokens == 0
    )
    assert scheduler.waiting_requests() == [second]
    steps = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        complete(scheduler, out)
        scheduler.block_pool.check()
        steps += 1
        assert steps < 50
    assert first.num_preemptions == 0 and second.num_preemptions == 1
    assert len(second.output_token_ids) == 4
    # The resumed request recomputed 9 tokens (prompt + first output) in one chunk.
    assert scheduler.block_pool.num_free == 4


def test_victim_scheduled_earlier_in_the_step_is_refunded():
    # vllm_priority: the worst request is picked even if it was already scheduled.
    scheduler = make_scheduler(num_blocks=4, policy="vllm_priority", max_num_batched_tokens=64)
    low = make_request(0, 4, 10, arrival_s=0.0, sla_level=0)
    high = make_request(1, 4, 10, arrival_s=1.0, sla_level=1)
    scheduler.add_request(low)
    scheduler.add_request(high)
    out = scheduler.schedule()
    complete(scheduler, out)  # both hold 1 block, prompt done, 1 output token each
    scheduler.block_pool.allocate(2)  # someone else took the rest of the pool
    out = scheduler.schedule()
    # high (admitted first: VIP) needs a 2nd block -> victim is low, which was not yet
    # scheduled; high then runs alone.
    assert [r.request_id for r in out.preempted] == [0]
    assert [(r.request_id, n) for r, n in out.chunks] == [(1, 1)]
    assert out.num_batched_tokens == 1
    assert low.block_ids == [] and low.num_computed_tokens == 0 and low.num_preemptions == 1


def test_requester_preempting_itself_waits():
    scheduler = make_scheduler(num_blocks=2, max_num_batched_tokens=64)
    only = make_request(0, 8, 5)
    scheduler.add_request(only)
    out = scheduler.schedule()
    complete(scheduler, out)  # 8 tokens fill both blocks; token 9 needs a third
    out = scheduler.schedule()
    assert out.preempted == [only] and out.chunks == []
    assert scheduler.block_pool.num_free == 2


def test_finish_request_from_waiting_and_running():
    scheduler = make_scheduler()
    a, b = make_request(0, 4, 2), make_request(1, 4, 2)
    scheduler.add_request(a)
    complete(scheduler, scheduler.schedule())
    scheduler.add_request(b)
    scheduler.finish_request(b, RequestState.ABORTED)
    scheduler.finish_request(a, RequestState.ABORTED)
    assert not scheduler.has_unfinished and scheduler.block_pool.num_free == 64


def test_recompute_from_scratch_clears_masked_prefixes():
    """KV recomputed from token 0 is exact: no head's prefix may stay masked after a restore
    fallback (or a recompute preemption)."""
    import numpy as np

    from preempt.engine.host_copies import recompute_from_scratch
    from tests.conftest import make_request

    request = make_request(0, 10, 5)
    request.num_computed_tokens = 10
    request.kv_masked_until = np.array([[8, 0]])
    recompute_from_scratch(request)
    assert request.num_computed_tokens == 0 and request.kv_masked_until is None


def test_admission_reserves_the_whole_sequence_like_vllm_032():
    # 10 blocks of 4 tokens. A runs with 6 blocks; B's 24-token prompt needs 6 more. Its first
    # 8-token chunk fits in the 4 free blocks, but vLLM 0.32 (scheduler_reserve_full_isl)
    # waits until the whole prompt fits; the old first-chunk rule admits it.
    for reserve, admitted in ((True, [0]), (False, [0, 1])):
        scheduler = make_scheduler(num_blocks=10, max_num_batched_tokens=8, reserve_full_sequence=reserve)
        a = make_request(0, 24, 8)
        scheduler.add_request(a)
        for _ in range(3):  # A's prompt in 3 chunks of 8: 6 blocks
            complete(scheduler, scheduler.schedule())
        scheduler.add_request(make_request(1, 24, 2, arrival_s=1.0))
        out = scheduler.schedule()
        assert [r.request_id for r, _ in out.chunks] == admitted, f"reserve_full_sequence={reserve}"


def test_vllm_priority_victim_ties_go_to_the_first_in_running_order():
    # Same priority and arrival: vLLM's max(running, key=(priority, arrival_time)) keeps the
    # first one it meets, not the highest request id.
    policy = get_policy("vllm_priority")
    running = [make_request(5, 4, 2, arrival_s=1.0), make_request(3, 4, 2, arrival_s=1.0)]
    assert policy.select_victim(running, 0.0) is running[0]


def test_baselines_have_no_failure_fallback_but_the_spec_design_does():
    # Eight requests that each need the whole pool by their end: they preempt each other
    # again and again. vLLM just keeps preempting; the SPEC design marks a request
    # PREEMPTION_FAILED after 3 preemptions (a victim of last resort from then on).
    from preempt.core.config import PreemptionConfig

    for policy, protected in (("vllm_fcfs", False), ("priority_score", True)):
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32)
        scheduler = Scheduler(config, get_policy(policy), BlockPool(12), 4, preemption=PreemptionConfig())
        assert scheduler.uses_failure_fallback is protected
        requests = [make_request(i, 4, 44, arrival_s=float(i)) for i in range(8)]
        for request in requests:
            scheduler.add_request(request)
        for _ in range(5000):
            if not scheduler.has_unfinished:
                break
            complete(scheduler, scheduler.schedule())
        assert not scheduler.has_unfinished
        assert max(r.num_preemptions for r in requests) >= 3
        assert any(r.preemption_failed for r in requests) is protected
        assert scheduler.backoff_until_s == 0.0 or protected


def test_next_to_admit_is_the_admission_order_read_from_the_heap():
    import random

    rng = random.Random(0)
    scheduler = make_scheduler(policy="vllm_priority")
    for i in range(200):  # ties in level and arrival: the counter orders them
        level, arrival = rng.randrange(3), float(rng.randrange(20))
        scheduler.add_request(make_request(i, 4, 3, arrival_s=arrival, sla_level=level))
    order = scheduler.waiting_requests()
    for k in (0, 1, 2, 7, 64, 200, 500):
        assert scheduler.next_to_admit(k) == order[:k]
    assert scheduler.waiting_requests() == order  # read-only
