"""`preempt bench early`'s save-stall split (SaveStallCauses): its parts add up to the
engine's save stall, and each cause is where the policy puts it."""

from __future__ import annotations

import pytest

from preempt.bench.early import SAVE_STALL_CAUSES, SaveStallCauses
from preempt.engine.engine import Engine
from tests.conftest import small_config
from tests.kv.test_preemption import AGGRESSIVE, _workload


def _measured(policy: str, **early):
    config = small_config(
        model={"backend": "null"},
        cache={"num_blocks": 40},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": "swap", **AGGRESSIVE},
        early_save={"policy": policy, **early},
    )
    engine = Engine(config)
    probe = SaveStallCauses(engine)
    engine.run(_workload(), on_step=probe)
    engine.close()
    return engine, probe


@pytest.mark.parametrize("policy", ["none", "rule", "always"])
def test_the_causes_add_up_to_the_save_stall(policy):
    engine, probe = _measured(policy)
    stall = engine.stats()["preemption_stall_save_s"]
    assert stall > 0 or policy == "always"
    assert sum(probe.stall_s.values()) == pytest.approx(stall, abs=1e-9)
    assert set(probe.stall_s) == set(SAVE_STALL_CAUSES)
    saves = [r for r in engine.scheduler.records if r.is_preemption and r.action == "save"]
    assert probe.num_saves == len(saves) > 0
    assert probe.num_saves_warned == sum(1 for r in saves if r.bytes_early)


def test_without_early_saves_every_stall_is_unwarned():
    _, probe = _measured("none")
    assert probe.stall_s["unwarned"] > 0
    assert all(v == 0 for k, v in probe.stall_s.items() if k != "unwarned")
    assert probe.num_saves_warned == probe.num_saves_refused == 0


def test_write_through_leaves_no_victim_unwarned():
    # `always` picks every running request after every step: a victim was picked (its
    # copies claimed, or refused), never unwarned; stall left is a copy still running or
    # the tail written since.
    _, always = _measured("always", max_inflight=64)
    assert always.stall_s["unwarned"] == 0 and always.num_saves_warned > 0
    assert always.num_saves_picked == always.num_saves
    # Under a one-block speculation budget most picks copy nothing: refused, not unwarned.
    _, tight = _measured("always", host_budget=8192)
    assert tight.num_saves_refused > 0 and tight.stall_s["unwarned"] == 0
    assert tight.stall_s["refused"] > 0


def test_one_arm_reports_its_row_with_the_split():
    from preempt.bench.early import one_arm

    row = one_arm("swap", "rule", None, quick=True)
    assert row["arm"] == "rule" and row["num_preemptions"] > 0
    assert sum(row["stall_save_by_cause_s"].values()) == pytest.approx(row["stall_save_s"], abs=1e-3)
    with pytest.raises(ValueError, match="arm must be"):
        one_arm("swap", "oracle_log", None)
    with pytest.raises(ValueError, match="needs --model"):
        one_arm("swap", "lstm", None)
    with pytest.raises(ValueError, match="the lstm_capped arm needs --model"):
        one_arm("swap", "lstm_capped", None)


def test_the_capped_arm_is_the_lstm_arm_with_the_waste_cap():
    from preempt.bench.early import WASTE_CAP_SETPOINT, arm_overrides

    plain = arm_overrides("swap", "lstm", "p.ckpt", 1600, 200, ["early_save.horizon_steps=4"], True)
    capped = arm_overrides("swap", "lstm_capped", "p.ckpt", 1600, 200, ["early_save.horizon_steps=4"], True)
    assert capped == [*plain, f"early_save.waste_cap={WASTE_CAP_SETPOINT}"]
    assert "early_save.policy=lstm" in plain and "early_save.checkpoint=p.ckpt" in plain
    assert "preemption.async_restore=true" in plain and "workload.start_s=1600" in plain
    none = arm_overrides("swap", "none", None, 1800, 60, [], False)
    assert none == [
        "workload.start_s=1800",
        "workload.duration_s=60",
        "preemption.mode=swap",
        "early_save.policy=none",
    ]


def test_the_forecast_arms_fork_knowing_only_the_present():
    from preempt.bench.early import FORECAST_EVERY_STEPS, arm_overrides

    every = arm_overrides("swap", "forecast", None, 1600, 200, ["early_save.horizon_steps=4"], True)
    sparse = arm_overrides("swap", "forecast_k4", None, 1600, 200, ["early_save.horizon_steps=4"], True)
    assert "early_save.policy=forecast" in every and "early_save.prefetch=true" in every
    assert sparse == [*every, f"early_save.lookahead_every_steps={FORECAST_EVERY_STEPS}"]
