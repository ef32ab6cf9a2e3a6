"""The plugin's decisions for the KV connector (preempt/integrations/vllm/saves.py) and the
connector's metrics on both routes (metrics.py), in preempt's own environment."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from preempt.integrations.vllm.decider import PreemptionDecider, RequestView
from preempt.integrations.vllm.kv_store import parse_connector_settings
from preempt.integrations.vllm.metrics import (
    CONNECTOR,
    LATENCY_BUCKETS,
    ConnectorMetrics,
    SnapshotCollector,
    SnapshotWriter,
    read_snapshots,
)
from preempt.integrations.vllm.saves import SavePlanner
from preempt.integrations.vllm.settings import parse_settings

BS = 32


def view(i: int, computed: int, max_tokens: int = 128, output: int = 0) -> RequestView:
    request = SimpleNamespace(
        request_id=f"r{i}", priority=0, num_prompt_tokens=computed - output, num_computed_tokens=computed,
        max_tokens=max_tokens, output_token_ids=[0] * output, num_output_tokens=output,
        num_tokens=computed + 1, num_preemptions=0, status=SimpleNamespace(name="RUNNING"),
    )  # fmt: skip
    return RequestView(request, arrival_s=float(i))


def planner(running, free_blocks, **settings):
    decider = PreemptionDecider(parse_settings(None))
    return SavePlanner(decider, parse_connector_settings(settings), BS, lambda: (running, free_blocks, 10.0))


def test_no_shortage_no_early_copies():
    running = [view(i, 40) for i in range(3)]  # 8 more tokens each stay in their second block
    assert (
        planner(running, free_blocks=0, early=True).early_targets({v.request_id: ([], 40) for v in running})
        == []
    )


def test_a_shortage_names_the_policys_next_victims():
    running = [view(i, 60) for i in range(4)]  # each needs a new block within 8 steps
    tables = {v.request_id: ([], 60) for v in running}
    plan = planner(running, free_blocks=1, early=True)
    victims = plan.early_targets(tables)
    order = [v.request_id for v in plan.decider.memory_victim_order(running, 10.0)]
    assert victims == order[:1]  # 4 new blocks, 1 free: a victim's 2 blocks and its own need cover it
    assert planner(running, free_blocks=4, early=True).early_targets(tables) == []


def test_expected_output_bounds_the_projection():
    running = [view(i, 60, max_tokens=128) for i in range(4)]
    for v in running:
        v.expected_output_left = 2  # learned lengths: they end before their next block
    assert (
        planner(running, free_blocks=0, early=True).early_targets({v.request_id: ([], 60) for v in running})
        == []
    )


def test_cost_rule_saves_while_a_copy_is_cheaper_than_a_prefill():
    plan = planner([], 0, saves="cost")
    plan.metrics = metrics = ConnectorMetrics()
    assert plan.should_save("r", 100)  # nothing measured yet: save
    plan.observe_save(100, 0.001)
    plan.observe_load(100, 0.001)
    plan.observe_step(8, 1.0)  # a decode step: not a prefill measurement
    assert plan.should_save("r", 100)
    plan.observe_step(256, 0.256)  # 1 ms a token to recompute, 0.02 ms to copy
    assert plan.should_save("r", 100)
    plan.observe_save(100, 1.0)  # copies turned slow
    assert not plan.should_save("r", 100)
    assert planner([], 0).should_save("r", 100)  # saves: all
    # each choice counted, and the prefill it was measured on (the bench judges them)
    assert metrics.cost_choices == {"save": 1, "recompute": 1, "unmeasured": 2}
    assert (metrics.prefill_tokens, metrics.prefill_s) == (256, pytest.approx(0.256))


def test_each_cost_choice_is_judged_against_the_save_all_and_recompute_arms():
    from preempt.bench.vllm_connector import COST_ARM, RECOMPUTE_ARM, SAVE_ALL_ARM, judge_cost

    def arm(**counters):
        return {"counters": {f"preempt:kv_{k}": v for k, v in counters.items()}}

    made = {"save": 3, "recompute": 5, "unmeasured": 2}
    choices = {f"cost_choices_total{{choice={c}}}": n for c, n in made.items()}
    arms = {
        COST_ARM: arm(**choices),
        # a save 2 us a token, a load 1 us: 3 us against a 10 us prefill
        SAVE_ALL_ARM: arm(save_seconds_sum=0.002, saved_tokens_total=1000, load_seconds_sum=0.001,
                          loaded_tokens_total=1000),
        RECOMPUTE_ARM: arm(prefill_seconds_total=0.01, prefill_tokens_total=1000),
    }  # fmt: skip
    judged = judge_cost(arms)
    assert judged["cheaper"] == "save" and (judged["right"], judged["wrong"]) == (5, 5)
    arms[RECOMPUTE_ARM] = arm(prefill_seconds_total=0.001, prefill_tokens_total=1000)  # 1 us: recompute
    judged = judge_cost(arms)
    assert judged["cheaper"] == "recompute" and (judged["right"], judged["wrong"]) == (5, 5)
    del arms[RECOMPUTE_ARM]
    assert judge_cost(arms)["cheaper"] is None  # a side not measured: no verdict


def test_connector_metrics_reach_the_collector(tmp_path):
    metrics = ConnectorMetrics()
    report = SimpleNamespace(num_tokens=64, error=None, raw_bytes=1000, stored_bytes=400, seconds=0.003)
    metrics.stored(report)
    metrics.loaded(report)
    metrics.loaded(SimpleNamespace(num_tokens=0, error="corrupt", raw_bytes=0, stored_bytes=0, seconds=0.0))
    snapshot = metrics.snapshot()
    assert snapshot["saves"] == snapshot["loads"] == 1 and snapshot["fallbacks"]["corrupt"] == 1
    assert snapshot["save_s"]["buckets"][LATENCY_BUCKETS.index(0.005)] == 1
    assert snapshot["save_s"]["buckets"][LATENCY_BUCKETS.index(0.0025)] == 0
    SnapshotWriter(tmp_path, CONNECTOR).write(snapshot)
    assert json.loads(next(tmp_path.glob("connector-*.json")).read_text()) == snapshot
    assert read_snapshots(tmp_path, CONNECTOR)["stored_bytes"] == 400
    families = {family.name: family for family in SnapshotCollector(tmp_path).collect()}
    assert "preempt:kv_saves" in families and "preempt:preemptions" not in families  # no scheduler wrote
    samples = {s.name: s.value for s in families["preempt:kv_save_seconds"].samples}
    assert samples["preempt:kv_save_seconds_count"] == 1 and samples["preempt:kv_save_seconds_sum"] == 0.003


def test_learned_lengths_reach_the_plugins_views(tmp_path):
    from preempt.engine.lengths import LengthModel
    from preempt.integrations.vllm.settings import SettingsError

    # a server that logged outputs of 10-30 tokens under a cap of 128
    LengthModel.fit([40] * 50, [128] * 50, [10 + i % 21 for i in range(50)]).save(tmp_path / "lengths.json")
    settings = parse_settings(
        {"preemption": {"remaining": "learned", "length_model": str(tmp_path / "lengths.json")}}
    )
    decider = PreemptionDecider(settings)
    running = [view(i, 60, max_tokens=128, output=20) for i in range(4)]
    decider.estimate(running)
    assert all(0 < v.expected_output_left < 20 for v in running)  # not the cap's 108
    plan = SavePlanner(decider, parse_connector_settings({"early": True}), BS, lambda: (running, 0, 10.0))
    assert plan.early_targets({v.request_id: ([], 60) for v in running})
    with pytest.raises(SettingsError, match="oracle"):
        parse_settings({"preemption": {"remaining": "oracle"}})
    with pytest.raises(SettingsError, match="length_model"):
        parse_settings({"preemption": {"remaining": "learned"}})
