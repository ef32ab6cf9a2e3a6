"""SGLang 0.5.23's loop (preempt/engine/sglang_scheduler.py), rule by rule, driven directly."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.block_pool import BlockPool
from preempt.core.config import PreemptionConfig, SchedulerConfig
from preempt.engine.policies import get_policy
from preempt.engine.sglang_scheduler import CLIP_MAX_NEW_TOKENS, SglangScheduler
from preempt.kv.record import KVMover, SaveResult
from tests.conftest import make_request
from tests.engine.test_scheduler import complete


def make(policy="sglang_fcfs", num_blocks=64, block_size=4, max_num_seqs=8, **sglang):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        policy=policy,
        sglang={"chunked_prefill_size": 32, "max_prefill_tokens": 64, **sglang},
    )
    return SglangScheduler(config, get_policy(policy, PreemptionConfig()), BlockPool(num_blocks), block_size)


def kinds(out) -> set[str]:
    """'decode' for a one-token step of a request whose prompt is done, else 'prefill'."""
    return {
        "decode" if r.num_computed_tokens >= r.num_prompt_tokens and r.num_output_tokens else "prefill"
        for r, _ in out.chunks
    }


def test_prefill_runs_first_and_never_shares_a_step_with_decode():
    s = make()
    s.add_request(make_request(0, 10, 6))
    out = s.schedule()
    assert kinds(out) == {"prefill"}
    complete(s, out)
    s.add_request(make_request(1, 10, 6))
    out = s.schedule()  # a waiting request: a prefill batch, the running one waits
    assert [r.request_id for r, _ in out.chunks] == [1] and kinds(out) == {"prefill"}
    complete(s, out)
    out = s.schedule()
    assert kinds(out) == {"decode"} and {r.request_id for r, _ in out.chunks} == {0, 1}


def test_one_chunked_request_at_a_time_and_it_goes_first():
    s = make()  # chunk budget 32 tokens
    long, short = make_request(0, 70, 3), make_request(1, 5, 3)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.chunks] == [(0, 32)]  # the chunk takes the budget
    assert s.chunked is long
    complete(s, out)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.chunks] == [(0, 32)]
    complete(s, out)
    out = s.schedule()  # the last 6 tokens, then the short one joins the same prefill batch
    assert [(r.request_id, n) for r, n in out.chunks] == [(0, 6), (1, 5)] and s.chunked is None


def test_admission_reserves_the_running_requests_expected_decode():
    # 20 blocks x 4 = 80 tokens. A running request (10-token prompt, max_tokens 60) is
    # expected to need 0.7 x 59 more tokens; a 24-token prompt with max_tokens 4 fits the
    # free blocks but not that reservation, so it waits and the running request decodes.
    s = make(num_blocks=20)
    s.add_request(make_request(0, 10, 60))
    complete(s, s.schedule())
    s.add_request(make_request(1, 24, 4))
    free = s.block_pool.num_free * 4
    offset = min(60 - 1, CLIP_MAX_NEW_TOKENS) * s.new_token_ratio
    assert 24 + 4 + 4 < free and not 24 + 4 + 4 < free - offset
    out = s.schedule()
    assert kinds(out) == {"decode"} and [r.request_id for r, _ in out.chunks] == [0]


def test_retraction_victim_fewest_outputs_then_longest_prompt():
    policy = get_policy("sglang_fcfs", PreemptionConfig())
    a, b, c = make_request(0, 10, 9), make_request(1, 30, 9), make_request(2, 20, 9)
    a.output_token_ids = [1, 2]
    b.output_token_ids = [1]
    c.output_token_ids = [1]
    assert policy.select_victim([a, b, c], 0.0) is b  # 1 output each for b, c; b's prompt is longer
    d = make_request(3, 30, 9)
    d.output_token_ids = [5]
    assert policy.select_victim([b, d], 0.0) is d  # a full tie: the last in the batch


def test_retraction_keeps_one_and_resets_the_ratio_from_the_kept():
    # Admission reserves only 0.7 x a running request's remaining max_tokens (decaying), so
    # a tight pool over-admits and a decode step must retract.
    rng = np.random.default_rng(0)
    s = make(num_blocks=24, max_num_seqs=16)
    requests = [
        make_request(i, int(rng.integers(2, 12)), int(rng.integers(5, 60)), arrival_s=float(i))
        for i in range(20)
    ]
    for r in requests:
        s.add_request(r)
    retracted = []
    for _ in range(5000):
        if not s.has_unfinished:
            break
        out = s.schedule()
        if out.preempted:
            retracted += out.preempted
            kept = [r for r, _ in out.chunks]
            assert kept and kinds(out) == {"decode"}
            expected = min(
                1.0,
                (sum(r.num_output_tokens for r in kept) + 20 * len(kept))
                / (sum(r.max_tokens for r in kept) + 1),
            )
            assert s.new_token_ratio == pytest.approx(expected)
        complete(s, out)
    assert retracted and not s.has_unfinished


def test_ratio_decays_per_decode_step_to_its_floor():
    s = make(num_blocks=400)
    s.add_request(make_request(0, 4, 900))
    complete(s, s.schedule())
    ratios = []
    for _ in range(700):
        complete(s, s.schedule())
        ratios.append(s.new_token_ratio)
    step = (0.7 - 0.7 * 0.14) / 600
    assert ratios[0] == pytest.approx(0.7 - step) and ratios[1] == pytest.approx(0.7 - 2 * step)
    assert ratios[-1] == pytest.approx(0.098)


@pytest.mark.parametrize(("threshold", "preempts"), [(0, True), (1, False)])
def test_priority_preemption_needs_a_full_batch_and_a_strictly_larger_gap(threshold, preempts):
    s = make("sglang_priority", max_num_seqs=2, priority_preemption_threshold=threshold)
    low = [make_request(i, 6, 50, arrival_s=float(i)) for i in range(2)]
    for r in low:
        s.add_request(r)
    complete(s, s.schedule())
    vip = make_request(9, 6, 5, arrival_s=5.0, sla_level=1)
    s.add_request(vip)
    out = s.schedule()
    if preempts:
        assert out.preempted == [low[1]]  # the lowest level, the latest queued
        assert [r.request_id for r, _ in out.chunks] == [9]
    else:
        assert not out.preempted and kinds(out) == {"decode"}


def test_no_priority_preemption_without_priority_scheduling():
    s = make("sglang_fcfs", max_num_seqs=2)
    for i in range(2):
        s.add_request(make_request(i, 6, 50, arrival_s=float(i)))
    complete(s, s.schedule())
    s.add_request(make_request(9, 6, 5, arrival_s=5.0, sla_level=2))
    out = s.schedule()
    assert not out.preempted


class _FailingMover(KVMover):
    """Every save fails as a blob over one host slot would."""

    def save(self, request, codec, now):
        return SaveResult("blob_too_large")

    def restore(self, request, now, *, background=False):
        raise AssertionError("nothing was saved")

    def discard(self, request):
        pass


def test_a_priority_victim_whose_save_fails_keeps_its_seat():
    # Regression (found by tests/engine/test_engine.py's random load): the victim's save
    # failed, so it kept running, yet the challenger was admitted too: 3 running > 2.
    config = SchedulerConfig(
        max_num_seqs=2,
        policy="sglang_priority",
        sglang={"chunked_prefill_size": 32, "max_prefill_tokens": 64, "priority_preemption_threshold": 0},
    )
    preemption = PreemptionConfig(mode="swap")
    s = SglangScheduler(
        config, get_policy("sglang_priority", preemption), BlockPool(64), 4, preemption, _FailingMover()
    )
    low = [make_request(i, 6, 50, arrival_s=float(i)) for i in range(2)]
    for r in low:
        s.add_request(r)
    complete(s, s.schedule())
    s.add_request(make_request(9, 6, 5, arrival_s=5.0, sla_level=1))
    out = s.schedule()
    assert [r.failure for r in out.records] == ["blob_too_large"]  # the attempt, kept running
    assert not out.preempted and len(s.running) == 2 and kinds(out) == {"decode"}
