"""The claims' judges on hand-made results: a verdict follows the intervals and the twins
that ran, and a mechanism that never acted is `idle`, not evidence either way. The report
on hand-made ablations: where it writes, what it prints, how it labels, its first screen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.claims import (
    CLAIMS,
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    Claim,
    Finding,
    claim_named,
    design_claims,
)
from experiments.report import glance, report
from experiments.tables import write_csv
from preempt.cli import main


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
    finding = claim_named("rate_limit").evaluate(arms)
    assert finding.verdict == HELD
    assert "cap 8" in finding.measured and "the cap was never reached" in finding.measured


def test_a_cap_passed_in_one_seed_does_not_hold():
    arms = {
        "slices_dynamic": _capped("slices_dynamic", None, [17, 9, 14]),
        "rate_limit_tight": _capped("rate_limit_tight", 8, [8, 9, 8]),
    }
    assert claim_named("rate_limit").evaluate(arms).verdict == NOT_HELD


def test_a_cap_never_reached_is_idle_and_a_missing_twin_is_not_measured():
    arms = {
        "slices_dynamic": _capped("slices_dynamic", None, [17, 9, 14]),
        "rate_limit": _capped("rate_limit", 30, [17, 9, 14]),
    }
    assert claim_named("rate_limit").evaluate(arms).verdict == IDLE
    assert claim_named("rate_limit").evaluate({"rate_limit": arms["rate_limit"]}).verdict == NOT_MEASURED


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
    finding = claim_named("zero_copy").evaluate(arms)
    assert finding.verdict == HELD
    assert "time_share_swap" in finding.measured and "swap_raw" in finding.measured
    del arms["time_share_swap"], arms["time_share_dynamic"]
    assert claim_named("zero_copy").evaluate(arms).verdict == INCONCLUSIVE


def test_zero_copy_without_any_preemption_is_idle():
    arms = {
        "swap_raw": _moves("swap_raw", [0, 0, 0], [0, 0, 0], preemptions=0),
        "pause": _moves("pause", [0, 0, 0], [0, 0, 0], preemptions=0),
    }
    assert claim_named("zero_copy").evaluate(arms).verdict == IDLE


def test_priority_claims_are_idle_without_priority_preemption_and_judged_against_their_baseline():
    def arm(name: str, ttft: list[float], priority: int) -> list[dict[str, Any]]:
        return _rows(name, sla2_ttft_p99_s=ttft, num_priority_preemptions=[priority] * len(ttft))

    fcfs, strict = arm("vllm_fcfs", [2.0, 2.5, 1.8], 0), arm("vllm_priority", [0.2, 0.25, 0.15], 0)
    quiet = {"vllm_fcfs": fcfs, "vllm_priority": strict, "score": arm("score", [2.0, 2.5, 1.8], 0)}
    assert claim_named("priority").evaluate(quiet).verdict == IDLE
    # better than FCFS (protects), worse than strict priority (the bar)
    arms = {"vllm_fcfs": fcfs, "vllm_priority": strict, "score": arm("score", [0.6, 0.7, 0.5], 4)}
    protects = claim_named("priority").evaluate(arms)
    assert protects.verdict == HELD and "(vllm_fcfs)" in protects.measured
    as_strict = design_claims("score")[1].evaluate(arms)
    assert as_strict.verdict == NOT_HELD and "(vllm_priority)" in as_strict.measured
    del arms["vllm_fcfs"]
    assert claim_named("priority").evaluate(arms).verdict == NOT_MEASURED


def test_as_well_as_strict_priority_is_non_inferiority_within_ten_percent():
    def arm(name: str, ttft: list[float]) -> list[dict[str, Any]]:
        return _rows(name, sla2_ttft_p99_s=ttft, num_priority_preemptions=[3] * len(ttft))

    strict = arm("vllm_priority", [1.0, 2.0, 1.5, 1.2])
    close = {"vllm_priority": strict, "score": arm("score", [1.02, 2.03, 1.51, 1.22])}  # +1-2%
    assert design_claims("score")[1].evaluate(close).verdict == HELD
    far = {"vllm_priority": strict, "score": arm("score", [1.5, 3.1, 2.2, 1.9])}  # +50%
    assert design_claims("score")[1].evaluate(far).verdict == NOT_HELD
    same = {"vllm_priority": strict, "score": arm("score", [1.0, 2.0, 1.5, 1.2])}
    assert design_claims("score")[1].evaluate(same).verdict == IDLE


def _objectives(name: str, goodput: list[float], ttft: list[float]) -> list[dict[str, Any]]:
    return _rows(name, goodput_req_s=goodput, sla2_ttft_p99_s=ttft, sla2_slo_attainment=[0.9] * len(ttft))


def test_the_design_is_on_the_front_only_when_it_beats_every_baseline_somewhere():
    design = _objectives("score", [4.0, 4.2, 4.1], [1.0, 1.1, 0.9])
    fast = _objectives("fastserve_mlfq", [5.0, 5.3, 5.1], [3.0, 3.3, 2.8])  # more goodput, worse TTFT
    strict = _objectives("vllm_priority", [3.0, 3.1, 3.2], [0.5, 0.6, 0.55])  # less goodput, better TTFT
    arms = {"score": design, "fastserve_mlfq": fast, "vllm_priority": strict}
    finding = design_claims("score")[0].evaluate(arms)
    assert finding.verdict == HELD and "fastserve_mlfq - score" in finding.measured
    dominant = _objectives("fastserve_mlfq", [5.0, 5.3, 5.1], [0.5, 0.6, 0.4])
    assert design_claims("score")[0].evaluate({**arms, "fastserve_mlfq": dominant}).verdict == NOT_HELD
    noisy = _objectives("fastserve_mlfq", [3.0, 5.3, 4.1], [0.5, 1.6, 0.9])  # tied on both
    assert design_claims("score")[0].evaluate({**arms, "fastserve_mlfq": noisy}).verdict == INCONCLUSIVE
    alike = {"score": design, "vllm_priority": _objectives("vllm_priority", [4.0, 4.2, 4.1], [1.0, 1.1, 0.9])}
    assert design_claims("score")[0].evaluate(alike).verdict == IDLE
    assert design_claims("score")[0].evaluate({"score": design}).verdict == NOT_MEASURED


def test_glance_counts_idle_points_apart():
    assert glance([HELD, IDLE, IDLE]) == "held 1/3, idle 2/3"
    assert glance([INCONCLUSIVE]) == INCONCLUSIVE
    assert glance([NOT_MEASURED, NOT_MEASURED]) == "–" and glance([NOT_MEASURED]) == NOT_MEASURED


def test_relative_changes_are_clipped_and_strict_priority_is_judged_by_a_difference():
    """The report's header says every interval is clipped to its range: a relative change
    `a / b - 1` to [-100%, inf); the strict-priority comparison, whose ratio no range
    bounds usefully, is a difference in seconds."""
    goodput = {"threshold_0": [10.0, 1.0, 10.0], "score": [1.0, 10.0, 1.0], "threshold_50": [1.0, 10.0, 1.0]}
    arms = {
        name: _rows(name, goodput_req_s=g, sla2_ttft_p99_s=[1.0, 1.0, 1.0]) for name, g in goodput.items()
    }
    measured = claim_named("threshold").evaluate(arms).measured
    assert "0.2 vs 0: +240.0% [-100.0%, +" in measured  # t alone: -663%

    def arm(name: str, ttft: list[float]) -> list[dict[str, Any]]:
        return _rows(name, sla2_ttft_p99_s=ttft, num_priority_preemptions=[3] * len(ttft))

    # A strict-priority TTFT near 0 in one seed: the mean ratio would be +1,000s of percent.
    strict, design = arm("vllm_priority", [0.01, 1.0, 2.0]), arm("score", [5.0, 1.2, 2.1])
    finding = design_claims("score")[1].evaluate({"vllm_priority": strict, "score": design})
    assert "%" not in finding.measured and "score - 1.1 x vllm_priority 1.66 [" in finding.measured
    assert finding.verdict == INCONCLUSIVE


def _ablation(path: Path, name: str, plots: tuple[str, ...], grid: dict | None = None) -> Path:
    """A minimal `preempt ablate` output: results.csv, ablation.json and plots."""
    rows = [
        {**row, "parent": "", "notes": "", "sla2_slo_attainment": 0.9}
        | {key.rsplit(".", 1)[-1]: values[0] for key, values in (grid or {}).items()}
        for arm in ("vllm_fcfs", "vllm_priority", "score")
        for row in _rows(arm, goodput_req_s=[3.0, 3.1, 3.2], sla2_ttft_p99_s=[1.0, 1.2, 1.1])
    ]
    configs = [{"run": row.pop("run"), "config": row.pop("_config")} for row in rows]
    for row, config in zip(rows, configs, strict=True):
        row["run"] = config["run"]
    path.mkdir(parents=True)
    write_csv(rows, path / "results.csv")
    info = {"name": name, "source": f"{name}.yaml", "runs": configs, **({"grid": grid} if grid else {})}
    (path / "ablation.json").write_text(json.dumps(info))
    (path / "plots").mkdir()
    for stem in plots:
        (path / "plots" / f"{stem}.png").write_bytes(b"\x89PNG")
    return path


@pytest.fixture
def claims_alike(monkeypatch):
    """As many claims as the report has, none measured (the hand-made rows lack their
    metrics): the glance table as long as the real one."""
    import experiments.report as report_module

    fake = [
        Claim(f"c{i}", "here", f"claim {i}", "how", lambda arms: Finding("–", NOT_MEASURED))
        for i in range(len(CLAIMS))
    ]
    monkeypatch.setattr(report_module, "CLAIMS", fake)


def test_report_writes_beside_out_prints_every_path_and_labels_ablations_by_name(
    tmp_path, capsys, claims_alike
):
    smoke = _ablation(tmp_path / "runs" / "smoke", "smoke", ("goodput", "ttft_cdf"))
    load = _ablation(
        tmp_path / "runs" / "load",
        "load",
        ("sweep_goodput_req_s_vs_rate_scale", "sweep_ttft_p99_s_vs_rate_scale"),
        grid={"workload.rate_scale": [1.0]},
    )
    out = tmp_path / "report" / "results.md"
    assert main(["report", "--quick", str(smoke), "--sweep", str(load), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    written = sorted(p for p in out.parent.iterdir())
    assert printed == [
        f"wrote {out}",
        f"wrote {out.parent / 'results'}/",
        f"wrote {out.parent / 'leaderboard.md'}",
    ] + [f"wrote {p}/" for p in written if p.name == "leaderboard"]
    assert {line.split()[1].rstrip("/") for line in printed} == {str(p) for p in written}
    text = out.read_text()
    # labelled by its config's name, not by the flag it came with
    assert (
        "| claim | source | smoke | load |" in text
        and (out.parent / "results" / "smoke" / "goodput.png").is_file()
    )
    assert "| quick |" not in text
    # the report's first screen: verdicts, then the load sweep's goodput against load
    lines = text.splitlines()
    figure = lines.index(
        "![sweep_goodput_req_s_vs_rate_scale](results/load/sweep_goodput_req_s_vs_rate_scale.png)"
    )
    assert figure < 40 and figure < lines.index("## What to run where")
    assert "clipped to the metric's range" in text and "a relative change `a / b - 1` to [-100%, inf)" in text


def test_report_without_a_load_sweep_shows_the_ablations_goodput_and_names_a_clash(tmp_path, claims_alike):
    first = _ablation(tmp_path / "a" / "quick", "quick", ("bytes_saved", "goodput"))
    again = _ablation(tmp_path / "b" / "quick", "quick", ("goodput",))  # the same config twice
    out = tmp_path / "results.md"
    paths = report(first, out, sweeps=[again])
    assert paths[:3] == [out, tmp_path / "results", tmp_path / "leaderboard.md"]
    lines = out.read_text().splitlines()
    assert lines.index("![goodput](results/quick/goodput.png)") < 40
    assert "| claim | source | quick | quick-quick | where its mechanism binds |" in lines
    assert (tmp_path / "results" / "quick-quick" / "goodput.png").is_file()


def test_report_defaults_to_runs_not_the_published_page():
    from preempt.cli.parser import build_parser

    args = build_parser().parse_args(["report", "--quick", "runs/main/ablate"])
    assert args.out == Path("runs/report/results.md")


def test_a_second_report_never_overwrites_the_first_ones_leaderboard(tmp_path, capsys, claims_alike):
    smoke = _ablation(tmp_path / "runs" / "smoke", "smoke", ())
    first = tmp_path / "docs" / "results.md"
    assert main(["report", "--quick", str(smoke), "--out", str(first)]) == 0
    board = (tmp_path / "docs" / "leaderboard.md").read_text()
    assert main(["report", "--quick", str(smoke), "--out", str(first)]) == 0  # its own: rewritten
    capsys.readouterr()
    other = tmp_path / "docs" / "mine.md"
    assert main(["report", "--quick", str(smoke), "--out", str(other)]) == 2
    assert "is the leaderboard of the report" in capsys.readouterr().err and not other.exists()
    assert (tmp_path / "docs" / "leaderboard.md").read_text() == board
    elsewhere = tmp_path / "docs" / "mine_leaderboard.md"
    assert main(["report", "--quick", str(smoke), "--out", str(other), "--leaderboard", str(elsewhere)]) == 0
    assert elsewhere.is_file() and "[mine_leaderboard.md](mine_leaderboard.md)" in other.read_text()
