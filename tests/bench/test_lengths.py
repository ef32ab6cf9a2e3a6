"""`preempt bench lengths`: the remaining-output estimators on held-out minutes."""

from __future__ import annotations

import json

from preempt.bench.lengths import bench_lengths, held_out_minutes, render_lengths
from preempt.cli import main


def test_the_minutes_are_the_lengths_sweeps_and_the_learned_model_beats_the_cap():
    assert held_out_minutes()[:3] == [0.0, 120.0, 240.0]
    result = bench_lengths(quick=True)
    assert [m["start_s"] for m in result["minutes"]] == [0.0, 120.0, 240.0]
    mae = result["mae_tokens"]
    assert mae["learned"]["hi"] < mae["max_tokens"]["lo"]
    share = result["learned_over_max_tokens"]
    assert 0 <= share["lo"] <= share["mean"] <= share["hi"] < 1
    table = render_lengths(result)
    assert "| learned (preempt.engine.lengths) |" in table and "3 held-out minutes" in table


def test_the_cli_prints_a_table_or_json(capsys):
    assert main(["bench", "lengths", "--quick"]) == 0
    assert "| estimator | MAE, tokens | vs max_tokens |" in capsys.readouterr().out
    assert main(["bench", "lengths", "--quick", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["mae_tokens"]) == {"max_tokens", "learned"}
