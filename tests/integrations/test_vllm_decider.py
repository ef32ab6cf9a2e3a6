"""The plugin's deciding side in preempt's own environment (no vLLM): settings, clocks,
the victim order against preempt's select_victim, the fallback and the rate cap."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from preempt.core.config import BackoffConfig, PreemptionConfig
from preempt.core.limits import AdmissionBackoff, RateWindow
from preempt.integrations.vllm.clock import ReplayClock, StepClock
from preempt.integrations.vllm.decider import PreemptionDecider, RequestView
from preempt.integrations.vllm.settings import PluginSettings, SettingsError, load_settings, parse_settings


def fake_request(i: int, rng: random.Random, status: str = "RUNNING", preemptions: int = 0):
    prompt = rng.randrange(1, 400)
    return SimpleNamespace(
        request_id=f"{i:08d}",
        priority=rng.randrange(-2, 3),
        num_prompt_tokens=prompt,
        num_computed_tokens=rng.randrange(0, prompt + 1),
        max_tokens=rng.randrange(1, 300),
        output_token_ids=[7] * rng.randrange(0, 5),
        num_output_tokens=0,
        num_tokens=prompt,
        num_preemptions=preemptions,
        status=SimpleNamespace(name=status),
    )


def views(n: int, seed: int) -> list[RequestView]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        view = RequestView(fake_request(i, rng), arrival_s=rng.choice([0.0, 0.5, 1.0, rng.random()]))
        view.preemption_failed = rng.random() < 0.2
        out.append(view)
    return out


@pytest.mark.parametrize("policy", ["priority_score", "vllm_fcfs", "vllm_priority", "sglang_priority"])
def test_victim_order_is_select_victim_again_and_again(policy):
    decider = PreemptionDecider(PluginSettings(policy=policy))
    for seed in range(30):
        running = views(12, seed)
        order = decider.memory_victim_order(running, now=2.0)
        left = list(running)
        for victim in order:
            candidates = [r for r in left if not r.preemption_failed] or left
            assert victim is decider.policy.select_victim(candidates, 2.0)
            left.remove(victim)
        assert not left


def test_priority_victim_falls_back_after_consecutive_preemptions():
    settings = PluginSettings(preemption=PreemptionConfig(min_time_slice_ms=0, max_consecutive_preemptions=2))
    decider = PreemptionDecider(settings)
    rng = random.Random(0)
    challenger = RequestView(fake_request(0, rng, status="WAITING"), arrival_s=0.0)
    challenger.sla_level = 5
    tired = RequestView(fake_request(1, rng, preemptions=2), arrival_s=0.0)
    fresh = RequestView(fake_request(2, rng), arrival_s=0.0)
    for view in (tired, fresh):
        view.slice_used_s = 1.0
    tired.sla_level, fresh.sla_level = -6, -4  # the policy names the tired one first
    assert decider.policy.select_victim([tired, fresh], 1.0) is tired
    victim = decider.priority_victim(challenger, [tired, fresh], now=1.0)
    assert victim is fresh  # the tired one took the fallback instead
    assert tired.preemption_failed and decider.metrics.failures == {"consecutive_limit": 1}
    assert decider.backoff.holds(1.0) and decider.held_by_backoff(challenger, 1.0)
    assert not decider.held_by_backoff(tired, 1.0)  # already ran: may resume


@pytest.mark.parametrize("counts", ["all", "priority"])
def test_rate_cap_refuses_priority_preemptions(counts):
    preemption = PreemptionConfig(max_preemption_per_min=1, rate_cap_counts=counts, min_time_slice_ms=0)
    decider = PreemptionDecider(PluginSettings(preemption=preemption))
    rng = random.Random(1)
    challenger = RequestView(fake_request(0, rng, status="WAITING"), arrival_s=0.0)
    challenger.sla_level = 9
    running = views(3, 2)
    for view in running:
        view.preemption_failed = False
        view.slice_used_s = 1.0
    decider.on_preempted(RequestView(fake_request(5, rng), 0.0), "memory", 0.5, 10)
    # a forced preemption fills the window only when `all` preemptions count
    blocked = decider.priority_victim(challenger, running, now=1.0) is None
    assert blocked == (counts == "all")
    assert decider.metrics.rate_limited == int(counts == "all")
    decider.on_preempted(running[0], "priority", 1.0, 10)  # a priority one always counts
    assert decider.priority_victim(challenger, running[1:], now=1.5) is None


def test_plugin_defaults_lay_under_user_settings():
    default = parse_settings(None).preemption
    assert default.rate_cap_counts == "priority"
    assert default.backoff.counts == "priority"  # vLLM's forced preemptions never hold admissions
    weights = default.priority_weights
    assert weights.age * weights.age_cap_s < weights.sla  # age never outranks a level
    # a nested section merges key by key: the user's threshold, the plugin's other defaults
    merged = parse_settings({"preemption": {"threshold": 0.3, "priority_weights": {"age": 0.1}}}).preemption
    assert merged.threshold == 0.3
    assert merged.priority_weights.age == 0.1 and merged.priority_weights.age_cap_s == weights.age_cap_s
    assert merged.rate_cap_counts == "priority" and merged.backoff == default.backoff
    engine_like = parse_settings(
        {"preemption": {"rate_cap_counts": "all", "priority_weights": {"age": 1.2, "age_cap_s": None}}}
    ).preemption
    assert engine_like.rate_cap_counts == "all" and engine_like.priority_weights.age_cap_s is None
    assert load_settings({}, {}).preemption == default


def test_limits():
    window = RateWindow(60.0)
    for t in (0.0, 10.0, 59.0):
        window.record(t)
    assert window.count(59.5) == 3 and window.count(60.0) == 2 and window.allows(60.0, 3)
    backoff = AdmissionBackoff(BackoffConfig(base_s=0.05, cap_s=0.15, reset_after_s=10.0))
    assert [backoff.on_failure(t) for t in (0.0, 1.0, 2.0)] == [0.05, 0.1, 0.15]
    assert backoff.on_failure(20.0) == 0.05  # reset after 10 s without a failure


def test_clocks():
    clock = StepClock(0.01)
    assert (
        clock.now() == 0.0
        and clock.start_step(3) == pytest.approx(0.03)
        and clock.now() == pytest.approx(0.04)
    )
    replay = ReplayClock([0.0, 0.5, 0.7], [0.2, 0.1, 0.3])
    assert replay.start_step(1) == 0.5 and replay.step_duration(1) == 0.1 and replay.now() == 0.7
    assert replay.start_step(4) == pytest.approx(0.7 + 2 * 0.3)


def test_settings_errors_name_the_field():
    with pytest.raises(SettingsError, match="field 'policy'"):
        parse_settings({"policy": "nope"})
    with pytest.raises(SettingsError, match="unknown field 'colour'"):
        parse_settings({"colour": 1})
    with pytest.raises(SettingsError, match="recompute"):
        parse_settings({"preemption": {"mode": "swap"}})
    with pytest.raises(SettingsError, match="not valid JSON"):
        load_settings({}, {"PREEMPT_VLLM_CONFIG": "{bad"})
    assert load_settings({"preempt": {"clock": "steps"}}).clock == "steps"
    assert load_settings({}, {"PREEMPT_VLLM_CONFIG": '{"step_ms": 5}'}).step_ms == 5
