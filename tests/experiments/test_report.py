"""The claims' judges on hand-made results: a verdict follows the intervals and the twins
that ran, and a mechanism that never acted is `idle`, not evidence either way."""

from __future__ import annotations

from typing import Any

from experiments.claims import (
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    _as_strict,
    _front,
    _rate_limit,
    _vip,
    _zero_copy,
)
from experiments.report import _glance


def _rows(arm: str, cap: int | None = 30, **metrics: list[float]) -> list[dict[str, Any]]:
    """One results row per seed; every metric given as one value per seed."""
    num = len(next(iter(metrics.values())))
    return [
        {
            "arm": arm,
            "run": f"{arm}@seed={seed}",
            "status": "ok",
            "_config": {
                "seed": seed,
                "preemption": {"max_preemption_per_min": cap, "mode": "pause"},
                "workload": {"sla_mix": {0: 0.9, 2: 0.1}},
            },
            **{name: values[seed] for name, values in metrics.items()},
        }
        for seed in range(num)
    ]


def _capped(arm: str, cap: int | None, peaks: list[float]) -> list[dict[str, Any]]:
    return _rows(arm, cap, peak_priority_preemptions_per_min=peaks, goodput_req_s=[4.0, 4.1, 4.2])


def test_a_cap_that_binds_and_is_kept_holds():
    arms = {
        "slices_dynamic": _capped("slices_dynamic", None, [17, 9, 14]),
        "rate_limit": _capped("rate_limit", 30, [17, 9, 14]),  # never reached: no evidence
        "rate_limit_tight": _capped("rate_limit_tight", 8, [8, 7, 8]),
    }
    finding = _rate_limit(arms)
    assert finding.verdict == HELD
    assert "cap 8" in finding.measured and "the cap was never reached" in finding.measured


def test_a_cap_passed_in_one_seed_does_not_hold():
    arms = {
        "slices_dynamic": _capped("slices_dynamic", None, [17, 9, 14]),
        "rate_limit_tight": _capped("rate_limit_tight", 8, [8, 9, 8]),
    }
    assert _rate_limit(arms).verdict == NOT_HELD


def test_a_cap_never_reached_is_idle_and_a_missing_twin_is_not_measured():
    arms = {
        "slices_dynamic": _capped("slices_dynamic", None, [17, 9, 14]),
        "rate_limit": _capped("rate_limit", 30, [17, 9, 14]),
    }
    assert _rate_limit(arms).verdict == IDLE
    assert _rate_limit({"rate_limit": arms["rate_limit"]}).verdict == NOT_MEASURED


def _moves(arm: str, moved: list[float], stall: list[float], preemptions: int = 5) -> list[dict[str, Any]]:
    return _rows(
        arm,
        kv_bytes_moved=moved,
        preemption_stall_s=stall,
        num_reclaims=[0] * len(moved),
        num_preemptions=[preemptions] * len(moved),
    )


def test_zero_copy_is_decided_by_time_sharing_first():
    arms = {
        # time sharing: the pause moves far less and stalls less -> held
        "time_share_swap": _moves("time_share_swap", [12e9, 11e9, 13e9], [0.24, 0.25, 0.26]),
        "time_share_dynamic": _moves("time_share_dynamic", [5e9, 4e9, 4.5e9], [0.10, 0.09, 0.11]),
        # the gate pair alone would be inconclusive (moves the same)
        "swap_raw": _moves("swap_raw", [7e9, 8e9, 6e9], [0.15, 0.14, 0.16]),
        "pause": _moves("pause", [7.1e9, 7.8e9, 6.2e9], [0.15, 0.15, 0.15]),
    }
    finding = _zero_copy(arms)
    assert finding.verdict == HELD
    assert "time_share_swap" in finding.measured and "swap_raw" in finding.measured
    del arms["time_share_swap"], arms["time_share_dynamic"]
    assert _zero_copy(arms).verdict == INCONCLUSIVE


def test_zero_copy_without_any_preemption_is_idle():
    arms = {
        "swap_raw": _moves("swap_raw", [0, 0, 0], [0, 0, 0], preemptions=0),
        "pause": _moves("pause", [0, 0, 0], [0, 0, 0], preemptions=0),
    }
    assert _zero_copy(arms).verdict == IDLE


def test_priority_claims_are_idle_without_priority_preemption_and_judged_against_their_baseline():
    def arm(name: str, ttft: list[float], priority: int) -> list[dict[str, Any]]:
        return _rows(name, sla2_ttft_p99_s=ttft, num_priority_preemptions=[priority] * len(ttft))

    fcfs, strict = arm("vllm_fcfs", [2.0, 2.5, 1.8], 0), arm("vllm_priority", [0.2, 0.25, 0.15], 0)
    quiet = {"vllm_fcfs": fcfs, "vllm_priority": strict, "score": arm("score", [2.0, 2.5, 1.8], 0)}
    assert _vip(quiet).verdict == IDLE
    # better than FCFS (protects), worse than strict priority (the bar)
    arms = {"vllm_fcfs": fcfs, "vllm_priority": strict, "score": arm("score", [0.6, 0.7, 0.5], 4)}
    assert _vip(arms).verdict == HELD and "(vllm_fcfs)" in _vip(arms).measured
    as_strict = _as_strict("score")(arms)
    assert as_strict.verdict == NOT_HELD and "(vllm_priority)" in as_strict.measured
    del arms["vllm_fcfs"]
    assert _vip(arms).verdict == NOT_MEASURED


def test_as_well_as_strict_priority_is_non_inferiority_within_ten_percent():
    def arm(name: str, ttft: list[float]) -> list[dict[str, Any]]:
        return _rows(name, sla2_ttft_p99_s=ttft, num_priority_preemptions=[3] * len(ttft))

    strict = arm("vllm_priority", [1.0, 2.0, 1.5, 1.2])
    close = {"vllm_priority": strict, "score": arm("score", [1.02, 2.03, 1.51, 1.22])}  # +1-2%
    assert _as_strict("score")(close).verdict == HELD
    far = {"vllm_priority": strict, "score": arm("score", [1.5, 3.1, 2.2, 1.9])}  # +50%
    assert _as_strict("score")(far).verdict == NOT_HELD
    same = {"vllm_priority": strict, "score": arm("score", [1.0, 2.0, 1.5, 1.2])}
    assert _as_strict("score")(same).verdict == IDLE


def _objectives(name: str, goodput: list[float], ttft: list[float]) -> list[dict[str, Any]]:
    return _rows(name, goodput_req_s=goodput, sla2_ttft_p99_s=ttft, sla2_slo_attainment=[0.9] * len(ttft))


def test_the_design_is_on_the_front_only_when_it_beats_every_baseline_somewhere():
    design = _objectives("score", [4.0, 4.2, 4.1], [1.0, 1.1, 0.9])
    fast = _objectives("fastserve_mlfq", [5.0, 5.3, 5.1], [3.0, 3.3, 2.8])  # more goodput, worse TTFT
    strict = _objectives("vllm_priority", [3.0, 3.1, 3.2], [0.5, 0.6, 0.55])  # less goodput, better TTFT
    arms = {"score": design, "fastserve_mlfq": fast, "vllm_priority": strict}
    finding = _front("score")(arms)
    assert finding.verdict == HELD and "fastserve_mlfq - score" in finding.measured
    dominant = _objectives("fastserve_mlfq", [5.0, 5.3, 5.1], [0.5, 0.6, 0.4])
    assert _front("score")({**arms, "fastserve_mlfq": dominant}).verdict == NOT_HELD
    noisy = _objectives("fastserve_mlfq", [3.0, 5.3, 4.1], [0.5, 1.6, 0.9])  # tied on both
    assert _front("score")({**arms, "fastserve_mlfq": noisy}).verdict == INCONCLUSIVE
    alike = {"score": design, "vllm_priority": _objectives("vllm_priority", [4.0, 4.2, 4.1], [1.0, 1.1, 0.9])}
    assert _front("score")(alike).verdict == IDLE
    assert _front("score")({"score": design}).verdict == NOT_MEASURED


def test_glance_counts_idle_points_apart():
    assert _glance([HELD, IDLE, IDLE]) == "held 1/3, idle 2/3"
    assert _glance([INCONCLUSIVE]) == INCONCLUSIVE
    assert _glance([NOT_MEASURED, NOT_MEASURED]) == "–" and _glance([NOT_MEASURED]) == NOT_MEASURED
