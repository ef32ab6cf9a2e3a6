"""`preempt bench early --windows` (preempt/bench/early_windows.py): the summary judges each
target by its interval over windows, clipped to each quantity's range; the command prints
a table and writes its results."""

from __future__ import annotations

import json

import pytest

from preempt.bench.early_windows import INTERVAL, render_windows, summarize_windows


def test_windows_summary_judges_each_target_by_its_interval():
    def arm(hidden, waste):
        return {"stall_hidden": hidden, "waste_share": waste}

    # Four windows; two checkpoints per LSTM arm, averaged within a window.
    rows = []
    for i, (oracle, lstm_a, lstm_b) in enumerate(
        [(0.97, 0.90, 0.88), (0.96, 0.86, 0.90), (0.98, 0.89, 0.87), (0.97, 0.88, 0.88)]
    ):
        rows.append(
            {
                "mode": "swap",
                "window_s": [i, i + 1],
                "arms": {
                    "lookahead": arm(oracle, 0.02),
                    "forecast": arm(oracle - 0.03, 0.08),
                    "forecast_k4": arm(0.85, 0.03),
                    "lstm": [arm(lstm_a, 0.40 + 0.01 * i), arm(lstm_b, 0.42)],
                    "lstm_capped": [arm(0.5 + 0.3 * (i % 2), 0.25), arm(0.6, 0.35)],
                },
            }
        )
    rows.append(
        {
            "mode": "swap_zstd",
            "window_s": [0, 1],
            "arms": {"lstm": [arm(0.99, None)], "lstm_capped": [arm(0.99, 0.2)]},
        }
    )
    summary = summarize_windows(rows)
    lstm = summary["swap"]["lstm"]
    assert lstm["stall_hidden"]["mean"] == pytest.approx((0.89 + 0.88 + 0.88 + 0.88) / 4, abs=1e-4)
    assert lstm["stall_hidden"]["n"] == 4 and lstm["stall_hidden"]["verdict"] == "held"  # all ~0.88 > 0.80
    assert lstm["waste_share"]["verdict"] == "did not hold"  # all ~0.42 > 0.30
    lead = lstm["oracle_lead"]
    assert lead["mean"] == pytest.approx((0.08 + 0.08 + 0.10 + 0.09) / 4, abs=1e-4)
    assert lead["lo"] < 0.10 < lead["hi"] and lead["verdict"] is None  # straddles: inconclusive
    added = lstm["minus_forecast_k4"]  # paired by window, no target
    assert added["stall_hidden"]["mean"] == pytest.approx((0.89 + 0.88 + 0.88 + 0.88) / 4 - 0.85, abs=1e-4)
    assert added["waste_share"]["mean"] == pytest.approx(0.4175 - 0.03, abs=1e-4)
    assert "verdict" not in added["stall_hidden"] and "minus_forecast_k4" not in summary["swap"]["forecast"]
    assert summary["swap"]["lstm_capped"]["waste_share"]["mean"] == pytest.approx(0.30)
    assert summary["swap"]["lookahead"]["waste_share"]["verdict"] == "held"
    assert "oracle_lead" not in summary["swap"]["lookahead"]
    forecast = summary["swap"]["forecast"]  # a single run a window, judged the same way
    assert forecast["oracle_lead"]["mean"] == pytest.approx(0.03, abs=1e-4)
    assert forecast["oracle_lead"]["verdict"] == "held" and forecast["waste_share"]["verdict"] == "held"
    assert "forecast" not in summary["swap_zstd"]  # not run there: not reported
    # One window: a mean but no interval, so no verdict; no early bytes: no waste at all.
    zstd = summary["swap_zstd"]
    one_window = {"mean": 0.99, "lo": None, "hi": None, "n": 1, "num_nan": 0, "verdict": None}
    assert zstd["lstm"]["stall_hidden"] == one_window
    assert zstd["lstm"]["waste_share"]["num_nan"] == 1  # counted, not dropped silently
    assert zstd["lstm"]["waste_share"]["mean"] is None and "oracle_lead" not in zstd["lstm"]


def test_windows_avoid_what_the_checkpoints_trained_on():
    from preempt.bench.early_windows import HELD_OUT_WINDOWS_S, choose_windows

    # no training on this trace: its held-out windows as they are
    other = [{"trace": "azure-code", "start_s": 0.0, "end_s": 3000.0}]
    assert choose_windows("azure-conv", 200.0, other) == list(HELD_OUT_WINDOWS_S)
    # the main job's windows (azure-conv from 1300, 1900, 2500 s): 1800 and 2000 overlap
    # [1900, 2100) and move to the first free slots of a 200 s scan (0 and 200 s)
    main = [{"trace": "azure-conv", "start_s": s, "end_s": s + 200.0} for s in (1300.0, 1900.0, 2500.0)]
    chosen = choose_windows("azure-conv", 200.0, main)
    assert chosen == [0.0, 200.0, 1600.0, 2200.0]
    for start in chosen:
        assert not any(start < w["end_s"] and w["start_s"] < start + 200.0 for w in main)
    # a window to the trace's end (end_s None) counts as such
    to_the_end = [{"trace": "azure-conv", "start_s": 1000.0, "end_s": None}]
    assert choose_windows("azure-conv", 200.0, to_the_end) == [0.0, 200.0, 400.0, 600.0]


def test_windows_of_any_trace_spread_over_it_and_a_full_overlap_is_refused(tmp_path):
    from preempt.bench.early_windows import choose_windows

    # mooncake-synthetic (1,022 s): four 200 s windows spread evenly, none overlapping
    chosen = choose_windows("mooncake-synthetic", 200.0, [])
    assert chosen[0] == 0.0 and chosen[-1] + 200.0 <= 1023.0 and len(chosen) == 4
    assert all(b - a >= 200.0 for a, b in zip(chosen, chosen[1:], strict=False))
    # a path: an Azure CSV of 34 requests over 990 s; trained on all of it -> refused
    path = tmp_path / "mine.csv"
    rows = [f"2023-11-16 18:{m:02d}:{s:02d}.0000000,100,20" for m in range(17) for s in (0, 30)][:34]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert len(choose_windows(str(path), 200.0, [])) == 4
    everything = [{"trace": str(path), "start_s": 0.0, "end_s": None}]
    with pytest.raises(ValueError, match="trained on \\[0, inf\\) s of it"):
        choose_windows(str(path), 200.0, everything)


def test_arms_picks_what_runs_and_what_is_judged(monkeypatch):
    """`--arms lookahead,lstm`: per window the synchronous `none`, the oracle in swap only,
    and each checkpoint's `lstm`; nothing else runs, and the summary judges those."""
    import preempt.bench.early_windows as windows

    ran = []

    def fake_run(overrides, out_dir, learned_lengths=False):
        ran.append(out_dir.name)
        assert learned_lengths == (out_dir.name == "projection_learned")
        regimes.update(o for o in overrides if o.startswith("workload.max_tokens_mode="))
        return {"stall_total_s": 1.0 if out_dir.name == "none" else 0.5, "waste_share": 0.1}

    regimes: set[str] = set()

    monkeypatch.setattr(windows, "run_arm", fake_run)
    monkeypatch.setattr(windows, "horizon_of", lambda model: ["early_save.horizon_ms=50.0"])
    monkeypatch.setattr(windows, "training_windows_of", lambda model: [])
    result = windows.bench_early_windows(True, ["a.ckpt", "b.ckpt"], arms=["lookahead", "lstm"])
    # quick: two windows; swap: none, lookahead, lstm x 2; swap_zstd: none, lstm x 2
    assert ran == ["none", "lookahead", "lstm", "lstm", "none", "lstm", "lstm"] * 2
    assert set(result["summary"]["swap"]) == {"lookahead", "lstm"}
    assert result["summary"]["swap"]["lstm"]["stall_hidden"]["mean"] == 0.5
    assert set(result["summary"]["swap_zstd"]) == {"lstm"} and result["arms"] == ["lookahead", "lstm"]
    assert result["training_windows"] == {"a.ckpt": [], "b.ckpt": []}
    with pytest.raises(ValueError, match="--arms: choose from lookahead, rule, forecast"):
        windows.bench_early_windows(True, ["a.ckpt"], arms=["lstm", "nope"])
    # the forecasts need no checkpoint; the learned projection is judged against its own
    ran.clear()
    result = windows.bench_early_windows(
        True, [], arms=["rule", "projection", "projection_learned"], max_tokens="noisy"
    )
    assert ran == ["none", "rule", "projection", "projection_learned"] * 4 and regimes == {
        "workload.max_tokens_mode=noisy"
    }
    assert result["max_tokens_mode"] == "noisy" and result["horizon"] == []
    assert result["summary"]["swap"]["projection_learned"]["minus_projection"]["stall_hidden"]["mean"] == 0.0
    with pytest.raises(ValueError, match="needs --model"):
        windows.bench_early_windows(True, [], arms=["lstm"])
    ran.clear()  # one mode only (the main job's)
    result = windows.bench_early_windows(True, [], arms=["projection"], modes=("swap",))
    assert ran == ["none", "projection"] * 2 and list(result["summary"]) == ["swap"]
    with pytest.raises(ValueError, match="--modes: choose from swap, swap_zstd"):
        windows.bench_early_windows(True, [], arms=["projection"], modes=("pause",))


def _two_windows(waste: tuple[float, float], hidden: tuple[float, float]) -> list[dict]:
    return [
        {
            "mode": "swap",
            "window_s": [i, i + 1],
            "arms": {
                "none_sync": {"stall_total_s": 1.0},
                "rule": {"stall_hidden": hidden[i], "waste_share": waste[i]},
                "projection": {"stall_hidden": hidden[i], "waste_share": waste[i]},
                "projection_learned": {"stall_hidden": hidden[i] - 0.5, "waste_share": 1 - waste[i]},
            },
        }
        for i in range(2)
    ]


def test_windows_intervals_stay_in_each_quantitys_range():
    """Two windows far apart (t = 12.7 at n = 2): a waste share's interval is clipped to
    [0, 1], stall hidden's to at most 1; differences of waste shares to [-1, 1]; the
    verdicts are those of the unclipped interval (every target is inside its range)."""
    summary = summarize_windows(_two_windows(waste=(0.1, 0.9), hidden=(0.6, 0.99)))["swap"]
    waste, hidden = summary["rule"]["waste_share"], summary["rule"]["stall_hidden"]
    assert (waste["lo"], waste["hi"]) == (0.0, 1.0) and waste["mean"] == pytest.approx(0.5)
    assert hidden["hi"] == 1.0 and hidden["lo"] < 0.6 and hidden["verdict"] is None
    added = summary["projection_learned"]["minus_projection"]
    assert (added["waste_share"]["lo"], added["waste_share"]["hi"]) == (-1.0, 1.0)
    assert added["stall_hidden"]["hi"] < 0  # -0.5 every window: a difference, not clipped


def test_windows_table_names_its_interval_and_reclips_an_old_result():
    """A result written before the intervals were clipped (its summary out of [0, 1])
    is shown with its summary computed again from the windows."""
    rows = _two_windows(waste=(0.1, 0.9), hidden=(0.6, 0.99))
    old = {"workload": "w", "windows": rows, "summary": {"swap": {"rule": {
        "stall_hidden": {"mean": 0.795, "lo": -1.68, "hi": 3.27},
        "waste_share": {"mean": 0.5, "lo": -0.70, "hi": 2.45},
    }}}}  # fmt: skip
    text = render_windows(old)
    assert INTERVAL in text and "-0.700" not in text and "2.450" not in text
    assert "| rule | 0.795 [" in text and "0.500 [0.000, 1.000]" in text


def _result(monkeypatch) -> None:
    import preempt.bench.early_windows as windows

    def fake(quick, models, trace, arms, *rest):
        rows = _two_windows(waste=(0.1, 0.2), hidden=(0.8, 0.9))
        return {"workload": "fake", "windows": rows, "summary": summarize_windows(rows)}

    monkeypatch.setattr(windows, "bench_early_windows", fake)


def test_bench_early_windows_prints_a_table_and_writes_its_results(monkeypatch, tmp_path, capsys):
    from preempt.cli import main

    _result(monkeypatch)
    out = tmp_path / "early"
    assert main(["bench", "early", "--windows", "--quick", "--arms", "rule", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| rule |" in printed and INTERVAL in printed and not printed.lstrip().startswith("{")
    assert f"wrote {out / 'result.json'}" in printed and f"wrote {out / 'results.md'}" in printed
    assert json.loads((out / "result.json").read_text())["workload"] == "fake"
    table = (out / "results.md").read_text()
    assert "| rule |" in table and f"--arms rule --out {out}`" in table
    # --json: the result alone on stdout (the main job redirects it to a file); files only
    # with an explicit --out (scripts run several at once)
    assert main(["bench", "early", "--windows", "--arms", "rule", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["workload"] == "fake" and f"wrote {out / 'result.json'}" in captured.err
    monkeypatch.chdir(tmp_path / "early")
    assert main(["bench", "early", "--windows", "--arms", "rule", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["workload"] == "fake" and not captured.err
    assert not (tmp_path / "early" / "runs").exists()
    assert main(["bench", "early", "--windows", "--arms", "rule"]) == 0  # the table: to runs/
    assert (tmp_path / "early" / "runs" / "bench" / "early_windows" / "results.md").is_file()


def test_out_applies_to_bench_early_windows_only(capsys):
    from preempt.cli import main

    assert main(["bench", "early", "--out", "x"]) == 2
    assert "--out applies to `bench early --windows` only" in capsys.readouterr().err
