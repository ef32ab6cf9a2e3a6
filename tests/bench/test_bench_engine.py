"""`preempt bench engine`'s phases: a replay's wall time split by the step's components
(behaviour only: these machines are too noisy to test speed)."""

import pytest

from preempt.bench.engine import PHASES, _replay_speed, replay_phases

NULL_MINUTE = {"model": {"backend": "null"}, "workload": {"trace": "azure-conv", "duration_s": 60}}
# Saves, an early saver and a restore prefetcher: every hook phase has work (the small
# host pool keeps the engine's start-up short).
WITH_HOOKS = {
    **NULL_MINUTE,
    "cache": {"num_blocks": 1500},
    "preemption": {"mode": "swap", "host_mem": "512MB", "slot_size": "64MB"},
    "early_save": {
        "policy": "always",
        "prefetch": True,
        "host_budget": "128MB",
        "prefetch_host_budget": "256MB",
    },
}


def _check(phases: dict) -> None:
    assert list(phases["s"]) == list(PHASES) == list(phases["us_per_step"])
    assert all(seconds >= 0 for seconds in phases["s"].values())
    # they split the instrumented run's wall time (each rounded to the millisecond)
    assert sum(phases["s"].values()) == pytest.approx(phases["total_s"], abs=0.01)
    for phase in PHASES:
        per_step_us = 1e6 * phases["s"][phase] / phases["num_steps"]
        assert phases["us_per_step"][phase] == pytest.approx(
            per_step_us, abs=500 / phases["num_steps"] + 0.01
        )


def test_a_null_replay_splits_into_phases_that_add_up_and_change_nothing():
    plain = _replay_speed(NULL_MINUTE)
    steps = []
    phases = replay_phases(NULL_MINUTE, on_step=steps.append)
    _check(phases)
    assert (phases["num_steps"], phases["sim_time_s"]) == (plain["num_steps"], plain["sim_time_s"])
    assert len(steps) >= phases["num_steps"]  # the hook saw every step (and the empty ones)
    for phase in ("schedule", "execute", "cost_model", "update_from_output", "on_step"):
        assert phases["s"][phase] > 0
    for phase in ("prefetcher", "early_saver"):  # not configured
        assert phases["s"][phase] == 0


def test_hooks_are_timed_and_the_engine_still_reads_them():
    phases = replay_phases(WITH_HOOKS)
    _check(phases)
    assert phases["s"]["prefetcher"] > 0 and phases["s"]["early_saver"] > 0
    assert phases["num_steps"] == _replay_speed(WITH_HOOKS)["num_steps"]


def test_a_forking_early_saver_counts_its_forks_once():
    # The forecast forks the engine (a deep copy, timers included) every step: the
    # fork's steps count in the early saver's phase only, so the phases still add up.
    config = {**NULL_MINUTE, "workload": {"trace": "azure-conv", "duration_s": 15}}
    config["early_save"] = {"policy": "forecast"}
    config["preemption"] = WITH_HOOKS["preemption"]
    phases = replay_phases(config)
    _check(phases)
    assert phases["s"]["early_saver"] > phases["s"]["schedule"]
    assert phases["num_steps"] == _replay_speed(config)["num_steps"]


def test_decode_runs_are_a_phase_of_their_own():
    plain = _replay_speed(NULL_MINUTE)
    phases = replay_phases(NULL_MINUTE)  # no step hook: the engine takes decode runs
    _check(phases)
    assert 0 < plain["num_steps_in_decode_runs"] < plain["num_steps"]
    assert phases["s"]["decode_runs"] > 0
    assert (phases["num_steps"], phases["sim_time_s"]) == (plain["num_steps"], plain["sim_time_s"])
    hooked = replay_phases(NULL_MINUTE, on_step=lambda output: None)
    assert hooked["s"]["decode_runs"] == 0  # a step hook sees every step: no runs


def test_every_standard_policy_replays_the_pressured_window():
    from preempt.bench.engine import STANDARD_POLICIES, pressured_replays

    result = pressured_replays(1)
    assert list(result) == list(STANDARD_POLICIES)
    for row in result.values():
        assert row["num_requests"] > 0 and row["num_steps"] > 0
        assert row["real_time_factor"] == pytest.approx(60 / row["wall_s"], rel=0.01)
    # the pool runs out: every policy preempts
    assert all(row["num_preemptions"] > 0 for row in result.values())


def test_the_readme_quotes_the_kept_pressured_bench():
    """The README's replay speeds are benchmarks/engine_2026-12-07b.json's."""
    import json
    from pathlib import Path

    from preempt.bench.engine import STANDARD_POLICIES

    root = Path(__file__).resolve().parents[2]
    kept = json.loads((root / "benchmarks/engine_2026-12-07b.json").read_text())
    row = next(line for line in (root / "README.md").read_text().splitlines() if "bench engine" in line)
    pressured = kept["pressured_azure_conv_10min_4x"]
    for policy in STANDARD_POLICIES:
        assert f"`{policy}`" in row
        assert f"{pressured[policy]['real_time_factor']:.0f}x" in row
        assert f"{pressured[policy]['wall_s']:.2f}" in row
        assert pressured[policy]["real_time_factor"] >= 500  # the row says "held"
    assert f"{kept['replay_azure_conv_full_hour_null']['wall_s']:.2f} s" in row
