"""The published end-to-end table: it loads and validates, and a point's prediction is the
sum of the engine steps it implies, priced by the cost model."""

import csv
import re

import pytest

from preempt.calibrate import published
from preempt.calibrate.published import PublishedError, load_published
from preempt.core.cost_model import CostModel, StepShape
from preempt.core.profiles import MODELS, TargetProfile, load_device


def _row(**changes):
    row = {
        "id": "hand",
        "source": "hand-made",
        "url": "https://example.invalid/table",
        "quote": "x | 1 | 100",
        "gpu": "H100 SXM",
        "device": "h100",
        "model": "llama2-7b",
        "precision": "bf16",
        "tp": "1",
        "batch": "2",
        "input_len": "3",
        "output_len": "3",
        "engine": "test",
        "engine_version": "0",
        "metric": "latency",
        "value": "100",
        "unit": "ms",
        "measures": "one batch end to end",
    }
    row.update(changes)
    return row


def _write(path, rows, header=published.COLUMNS):
    with open(path, "w", newline="") as f:
        f.write("# attribution line\n")
        w = csv.DictWriter(f, fieldnames=list(header), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def test_bundled_table_loads_from_several_sources_and_each_value_is_in_its_quote():
    points = load_published()
    assert len(points) >= 5
    assert len({p.source.split(" ")[0] for p in points}) >= 2
    for p in points:
        assert p.url.startswith("https://")
        numbers = {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", p.quote)}
        assert p.value in numbers, p.id  # the value is the quoted cell, not a derived number
        assert p.measured_s > 0


def test_hand_made_row_round_trips(tmp_path):
    (point,) = load_published(_write(tmp_path / "t.csv", [_row()]))
    assert (point.tp, point.batch, point.input_len, point.output_len) == (1, 2, 3, 3)
    assert point.measured_s == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tp": "two"}, "tp"),
        ({"batch": "0"}, "batch"),
        ({"value": "-3"}, "value"),
        ({"value": "fast"}, "value"),
        ({"model": "gpt-j-6b"}, "model"),
        ({"device": "b200"}, "device"),
        ({"precision": "fp8"}, "precision"),
        ({"metric": "ttft"}, "metric"),
        ({"unit": "tok/s"}, "unit"),
        ({"metric": "first_token_latency", "output_len": "5"}, "output_len"),
        ({"metric": "tokens_per_s_per_seq", "unit": "tok/s"}, "batch"),
        ({"tp": "3"}, "tp"),
        ({"quote": ""}, "quote"),
    ],
)
def test_malformed_row_is_refused_naming_the_field(tmp_path, change, field):
    path = _write(tmp_path / "bad.csv", [_row(id="ok"), _row(id="bad", **change)])
    with pytest.raises(PublishedError, match=rf"row 2 \(bad\): {field}:"):
        load_published(path)


def test_missing_column_and_duplicate_id_are_refused(tmp_path):
    header = [c for c in published.COLUMNS if c != "unit"]
    with pytest.raises(PublishedError, match="unit"):
        load_published(_write(tmp_path / "a.csv", [_row()], header=header))
    with pytest.raises(PublishedError, match="id: duplicate"):
        load_published(_write(tmp_path / "b.csv", [_row(), _row()]))


def test_throughput_metrics_convert_to_the_seconds_they_span(tmp_path):
    rows = [
        _row(id="seq", metric="tokens_per_s_per_seq", unit="tok/s", batch="1", output_len="100", value="50"),
        _row(id="out", metric="output_tokens_per_s", unit="tok/s", batch="4", output_len="100", value="200"),
    ]
    seq, out = load_published(_write(tmp_path / "t.csv", rows))
    assert seq.measured_s == pytest.approx(2.0)  # 100 tokens at 50 tok/s
    assert out.measured_s == pytest.approx(2.0)  # 4 x 100 tokens at 200 tok/s


def test_prediction_is_the_hand_built_steps_priced_by_the_cost_model(tmp_path):
    (point,) = load_published(_write(tmp_path / "t.csv", [_row()]))  # batch 2, input 3, output 3
    cost = CostModel(TargetProfile("h", MODELS["llama2-7b"], 1, load_device("h100")))
    by_hand = [
        StepShape(6, 2 * (1 + 2 + 3), 6, 2),  # both prompts: positions 0..2 see 1..3 keys
        StepShape(2, 2 * 4, 2 * 4, 2),  # first decode: each sequence at context 4
        StepShape(2, 2 * 5, 2 * 5, 2),  # second decode: context 5 (3 output tokens in all)
    ]
    expected = sum(cost.step_time_s(s) for s in by_hand)
    got = published.predict(point)
    assert got.num_steps == 3
    assert got.predicted_s == pytest.approx(expected, rel=1e-12)
    assert got.gpu_s == pytest.approx(expected - 3 * cost.target.device.cpu_step_overhead_s, rel=1e-12)
    assert got.all_reduce_s == 0.0  # one GPU

    (ttft,) = load_published(_write(tmp_path / "f.csv", [_row(metric="first_token_latency", output_len="1")]))
    assert published.predict(ttft).predicted_s == pytest.approx(cost.step_time_s(by_hand[0]), rel=1e-12)


def test_tensor_parallel_point_charges_the_all_reduces(tmp_path):
    (point,) = load_published(_write(tmp_path / "t.csv", [_row(tp="2", model="llama3-8b")]))
    got = published.predict(point)
    assert got.all_reduce_s > 0
    cost = CostModel(TargetProfile("h", MODELS["llama3-8b"], 2, load_device("h100")))
    assert got.predicted_s == pytest.approx(
        sum(cost.step_time_s(s) for s in published.steps(point)), rel=1e-12
    )
