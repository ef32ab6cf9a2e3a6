"""`preempt bench clock`'s published section: predicted / measured per point and summary."""

import json
import math
from pathlib import Path

import pytest

from preempt.bench.clock import measured_fidelity, published_fidelity
from preempt.calibrate import published
from preempt.calibrate.published import parse_row
from preempt.core.profiles import ProfileError


def _point(value_ms):
    return parse_row(
        {
            "id": "hand",
            "source": "hand-made table",
            "url": "https://example.invalid",
            "quote": f"x | {value_ms}",
            "gpu": "H200",
            "device": "h200",
            "model": "llama3-8b",
            "precision": "bf16",
            "tp": "1",
            "batch": "1",
            "input_len": "16",
            "output_len": "1",
            "engine": "test",
            "engine_version": "0",
            "metric": "first_token_latency",
            "value": str(value_ms),
            "unit": "ms",
            "measures": "prefill",
        }
    )


def test_published_section_compares_a_hand_made_point_with_its_prediction():
    predicted = published.predict(_point(1.0)).predicted_s  # one prefill step of 16 tokens
    # a point measured at twice the prediction: ratio 0.5, outside +-15%
    out = published_fidelity([_point(round(2 * predicted * 1e3, 6))])
    (row,) = out["points"]
    assert row["steps"] == 1
    assert row["predicted_ms"] == pytest.approx(predicted * 1e3, abs=0.01)
    assert row["ratio"] == pytest.approx(0.5, abs=1e-3)
    summary = out["all"]["with_host_overhead"]
    assert summary["n"] == 1
    assert summary["rms_log"] == pytest.approx(abs(math.log(0.5)), abs=1e-3)
    assert summary["within_15pct"] == 0.0
    assert out["held_out"] is True
    assert out["multi_gpu"]["with_host_overhead"] == {"n": 0}


def test_published_section_covers_every_bundled_point():
    out = published_fidelity()
    assert out["all"]["with_host_overhead"]["n"] == len(published.load_published())
    assert set(out["by_source"]) == {p.source.split(" ")[0] for p in published.load_published()}


def test_the_constants_are_scored_without_tables_and_the_tables_on_counts_they_lack():
    from preempt.bench.clock import (
        ELEMENTWISE_OPS,
        LINEAR_OPS,
        _cost,
        _predicted,
        analytic,
        op_fidelity,
        table_fidelity,
    )
    from preempt.calibrate import vidur
    from preempt.core.profiles import load_device

    device = load_device("h100")  # with Vidur's measured tables for llama2-7b
    formula = _cost("llama2-7b", 1, analytic(device))
    # measured = 1.5x the formula everywhere: a table recovers that exactly between its
    # counts, while the constants alone are 1.5x off
    points = [
        vidur.OpPoint("h100", "llama2-7b", 1, op, t, 1.5 * _predicted(formula, op, t))
        for op in (*LINEAR_OPS, *ELEMENTWISE_OPS)
        for t in (1, 8, 16, 24, 40, 64, 128, 200, 512, 1024, 1040, 4096)  # some off the calibration grid
    ]
    assert op_fidelity(analytic(device), points)["layer"]["rms_log"] == pytest.approx(math.log(1.5), abs=1e-4)
    tables = table_fidelity(device, points)
    for split in ("interleaved", "calibration_grid"):
        assert tables[split]["all_points"]["n"] > 0
        assert tables[split]["all_points"]["rms_log"] == pytest.approx(0.0, abs=1e-4)


MEASURED_H200 = Path(__file__).parents[2] / "benchmarks" / "gpu_2026-12-04" / "h200-measured-v2.json"


def test_a_gpu_calibration_scores_the_bundled_profile_of_its_gpu():
    result = measured_fidelity(MEASURED_H200)
    assert result["measured"].startswith("NVIDIA H200, llama3-8b")
    assert result["profile"].startswith("preempt/profiles/h200.json")
    # every layer op at all 164 measured token counts, a whole layer at each
    assert all(summary["n"] == 164 for summary in result["by_op"].values())
    assert len(result["by_op"]) == 9 and result["layer"]["n"] == 164
    assert [row["tokens"] for row in result["layer_table"]] == [
        1,
        8,
        32,
        128,
        256,
        384,
        512,
        1024,
        2048,
        4096,
    ]
    assert all(
        row["ratio"] == pytest.approx(row["predicted_us"] / row["measured_us"], abs=2e-3)
        for row in result["layer_table"]
    )


def test_a_file_that_is_no_gpu_calibration_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "device"}')
    with pytest.raises(ProfileError, match="no measurement in it"):
        measured_fidelity(bad)
    data = json.loads(MEASURED_H200.read_text())
    data["measurements"]["device"] = "NVIDIA B200"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="no profile is bundled"):
        measured_fidelity(bad)
