"""The gate around priority preemption (preempt.engine.gate): one implementation that
preempt's Scheduler and the vLLM plugin's decider both call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from preempt.core.block_pool import BlockPool
from preempt.core.config import BackoffConfig, PreemptionConfig, SchedulerConfig
from preempt.engine.gate import PreemptionGate
from preempt.engine.policies import get_policy
from preempt.engine.scheduler import Scheduler
from preempt.integrations.vllm.decider import PreemptionDecider
from preempt.integrations.vllm.settings import PluginSettings
from tests.engine.test_scheduler import complete, make_request


def req(slice_used_s=1.0, failed=False, preemptions=0, num_tokens=100):
    return SimpleNamespace(
        slice_used_s=slice_used_s,
        preemption_failed=failed,
        num_preemptions=preemptions,
        num_tokens=num_tokens,
    )


def test_eligible_needs_a_used_slice_and_no_failure():
    gate = PreemptionGate(PreemptionConfig(), get_policy("priority_score"))
    done, young, failed = req(1.0), req(0.001), req(1.0, failed=True)
    assert gate.eligible([done, young, failed]) == [done]
    # a policy without time slices takes any request that has not failed
    no_slices = PreemptionGate(PreemptionConfig(), get_policy("vllm_priority"))
    assert no_slices.eligible([young, failed]) == [young]


def test_priority_victim_asks_again_after_a_fallback_and_stops_at_the_cap():
    class Lowest:
        uses_time_slices = False
        uses_failure_fallback = True
        preempts_for_priority = True

        def priority_victim(self, challenger, candidates, now):
            return candidates[0] if candidates else None

    gate = PreemptionGate(PreemptionConfig(max_preemption_per_min=1, max_consecutive_preemptions=2), Lowest())
    tired, fresh = req(preemptions=2), req()

    def take(victim):
        if gate.over_consecutive_limit(victim):
            gate.on_failure(victim, 0.0, forced=False)
            return False
        return True

    assert gate.priority_victim(None, [tired, fresh], 0.0, fresh=False, take=take) is fresh
    assert tired.preemption_failed and gate.backoff.holds(0.0)
    assert gate.priority_victim(None, [fresh], 0.0, fresh=True, take=take) is None  # held
    gate.on_preempted(0.0, forced=False)
    assert gate.priority_victim(None, [fresh], 1.0, fresh=False, take=take) is None  # the cap
    assert gate.num_rate_limited == 1


@pytest.mark.parametrize("counts", ["all", "priority"])
def test_backoff_counts_which_failures_start_it(counts):
    preemption = PreemptionConfig(backoff=BackoffConfig(counts=counts))
    gate = PreemptionGate(preemption, get_policy("priority_score"))
    forced = req(preemptions=3)
    assert gate.on_failure(forced, 1.0, forced=True)  # marked either way
    assert forced.preemption_failed and not gate.on_failure(forced, 1.0, forced=True)
    assert gate.backoff.holds(1.01) == (counts == "all")
    gate.on_failure(req(), 2.0, forced=False)  # a failed priority preemption always counts
    assert gate.backoff.holds(2.01)


def test_without_the_fallback_nothing_is_marked():
    gate = PreemptionGate(PreemptionConfig(), get_policy("vllm_fcfs"))
    victim = req(preemptions=9)
    assert not gate.over_consecutive_limit(victim)
    assert not gate.on_failure(victim, 0.0, forced=True) and not victim.preemption_failed
    assert not gate.backoff.holds(0.0)


@pytest.mark.parametrize("counts", ["all", "priority"])
def test_engine_and_plugin_share_the_forced_fallback_rule(counts):
    # Eight requests that each need the whole pool: forced preemptions mark requests
    # PREEMPTION_FAILED on both sides; only `counts: all` backs admissions off for it.
    preemption = PreemptionConfig(backoff=BackoffConfig(counts=counts))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        get_policy("priority_score"),
        BlockPool(12),
        4,
        preemption=preemption,
    )
    requests = [make_request(i, 4, 44, arrival_s=float(i)) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    for step in range(5000):
        if not scheduler.has_unfinished:
            break
        complete(scheduler, scheduler.schedule(now=step * 0.01))
    assert not scheduler.has_unfinished and any(r.preemption_failed for r in requests)
    assert (scheduler.backoff_until_s > 0.0) == (counts == "all")

    decider = PreemptionDecider(PluginSettings(preemption=preemption))
    view = SimpleNamespace(preemption_failed=False, num_preemptions=3, slice_used_s=0.0, preempted_at_s=None)
    decider.on_preempted(view, "memory", 1.0, 10)
    assert view.preemption_failed and decider.metrics.num_preemption_failed == 1
    assert decider.backoff.holds(1.01) == (counts == "all")
