"""Calibration from a real vLLM's step logs: reading them, which steps are timed, and the
fit recovering a clock it was generated from. The logs here are written by hand in the
step logger's format; tests/bench/test_fidelity.py runs the logger inside vLLM."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest

from preempt.calibrate.vllm_steps import calibrate_vllm, errors, read_step_log, shape_of, timed_steps
from preempt.core.cost_model import CostModel, step_shape
from preempt.core.profiles import ModelShape, ProfileError, TargetProfile, load_device, load_target

MODEL = {"name": "m", "num_layers": 8, "hidden_size": 512, "num_q_heads": 8, "num_kv_heads": 4,
         "head_dim": 64, "intermediate_size": 1536, "vocab_size": 256}  # fmt: skip
HEADER = {"kind": "header", "vllm_version": "0.32.0", "dtype": "float32", "model": MODEL, "block_size": 32}


def _truth() -> CostModel:
    """A CPU-like clock to generate steps from: the H200's formula with slower rates."""
    device = load_device("h200")
    device = dataclasses.replace(
        device,
        linear_flops_per_s=60e9,
        linear_bytes_per_s=12e9,
        linear_floor_s=0.0,
        attn_kv_bytes_per_s=6e9,
        attn_flops_per_s=30e9,
        attn_floor_s=0.0,
        attn_per_row_head_s=2e-8,
        attn_exponent=2.0,
        attn_masked_share=1.0,
        elementwise={op: (0.0, 4e9, 0.0, 2.0) for op in device.elementwise},
        cpu_step_overhead_s=4e-3,
        op_tables={},
    )
    return CostModel(TargetProfile("truth", ModelShape(**MODEL, dtype_bytes=4), 1, device))


def _write_log(path, truth: CostModel, num_steps: int = 400, noise: float = 0.0, seed: int = 0) -> None:
    """Steps of 1-16 sequences, decodes and prefill chunks mixed, timed by `truth` (times a
    lognormal noise), back to back; every 50th step ends a busy period."""
    rng = random.Random(seed)
    t = 1000.0
    lines = [HEADER]
    for i in range(num_steps):
        chunks = [[rng.randrange(0, 1500), 1] for _ in range(rng.randrange(1, 16))]
        if rng.random() < 0.3:
            chunks.append([rng.choice([0, 256, 512]), rng.choice([16, 128, 512])])
        seconds = truth.step_time_s(step_shape(chunks)) * math.exp(rng.gauss(0.0, noise))
        busy = i % 50 != 49
        ids = [f"r{k}" for k in range(len(chunks))]
        lines.append({"kind": "step", "step": i, "t": t, "end": t + seconds, "busy": busy, "ids": ids,
                      "chunks": chunks, "preempted": [], "waiting": 0, "free_blocks": 10})  # fmt: skip
        t += seconds + (0.0 if busy else 5.0)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_fit_recovers_the_clock_it_was_generated_from(tmp_path):
    truth = _truth()
    _write_log(tmp_path / "steps.jsonl", truth)
    profile = calibrate_vllm([tmp_path / "steps.jsonl"], copy=(1e10, "given"))
    assert profile["fit"]["rms_log"] < 0.02
    assert profile["fit"]["sum_ratio"] == pytest.approx(1.0, abs=0.02)
    # the written profile is a target file the engine loads by path
    (tmp_path / "t.json").write_text(json.dumps(profile))
    target = load_target(tmp_path / "t.json")
    assert target.model == ModelShape(**MODEL, dtype_bytes=4)
    fitted = CostModel(target)
    for chunks in ([[100, 1]] * 8, [[0, 512]], [[0, 300], [700, 1], [20, 1]]):
        shape = step_shape(chunks)
        assert fitted.step_time_s(shape) == pytest.approx(truth.step_time_s(shape), rel=0.05)


def test_noise_and_outliers_do_not_bend_the_shape_and_the_total_is_the_measured_one(tmp_path):
    truth = _truth()
    _write_log(tmp_path / "steps.jsonl", truth, noise=0.1, seed=1)
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    # 10% noise, and one step in 20 stretched 3x (a GC pause, the OS); each step's `t`
    # follows the previous one's end while busy
    t, out = 1000.0, [lines[0]]
    for k, line in enumerate(lines[1:], 1):
        step = json.loads(line)
        length = (step["end"] - step["t"]) * (3.0 if k % 20 == 5 else 1.0)
        step["t"], step["end"] = t, t + length
        t += length + (0.0 if step["busy"] else 5.0)
        out.append(json.dumps(step))
    (tmp_path / "steps.jsonl").write_text("\n".join(out) + "\n")
    fit = calibrate_vllm([tmp_path / "steps.jsonl"], copy=(1e10, "given"))
    (tmp_path / "t.json").write_text(json.dumps(fit))
    fitted = CostModel(load_target(tmp_path / "t.json"))
    # the fitted steps add up to the measured ones, stretched steps included: a replay's
    # clock adds up the mean step, not the typical one
    measured = [(shape_of(step), s) for step, s in timed_steps(read_step_log(tmp_path / "steps.jsonl"))]
    assert errors(fitted, measured)["sum_ratio"] == pytest.approx(1.0, abs=1e-3)
    # and the shape is the clean one: on fresh steps of the same mix, timed exactly, the
    # fitted clock is the true one times one factor (the stretched steps' share of the time)
    _write_log(tmp_path / "fresh.jsonl", truth, seed=2)
    fresh = [(shape_of(step), s) for step, s in timed_steps(read_step_log(tmp_path / "fresh.jsonl"))]
    ratios = np.array([fitted.step_time_s(shape) / s for shape, s in fresh])
    assert np.std(np.log(ratios)) < 0.05
    # that factor is the fit log's measured time over what the true clock gives its steps
    stretch = sum(s for _, s in measured) / sum(truth.step_time_s(shape) for shape, _ in measured)
    assert stretch > 1.05  # the stretched steps show
    assert ratios.mean() == pytest.approx(stretch, rel=0.03)


def test_only_steps_followed_at_once_by_another_are_timed(tmp_path):
    _write_log(tmp_path / "steps.jsonl", _truth(), num_steps=100)
    log = read_step_log(tmp_path / "steps.jsonl")
    timed = timed_steps(log)
    # steps 49 and 99 end busy periods (idle after them); the last has no successor
    assert len(timed) == 98
    assert all(step["busy"] for step, _ in timed)
    for step, seconds in timed:
        assert seconds == pytest.approx(step["end"] - step["t"])
    # a window: only steps that began inside it
    first = log.steps[10]["t"]
    assert [s["step"] for s, _ in timed_steps(log, first, log.steps[20]["t"])] == list(range(10, 20))


def test_a_file_that_is_not_a_step_log_is_refused_by_name(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"kind": "step", "t": 1}\n')
    with pytest.raises(ProfileError, match="x.jsonl: no header"):
        read_step_log(path)
    path.write_text(json.dumps(HEADER) + "\nnot json\n{}\n")
    with pytest.raises(ProfileError, match="x.jsonl: line 2 is not JSON"):
        read_step_log(path)
    # a server killed mid-write leaves a partial last line: skipped
    path.write_text(json.dumps(HEADER) + '\n{"kind": "st')
    assert read_step_log(path).steps == []
    with pytest.raises(ProfileError, match="no timed steps"):
        calibrate_vllm([path])
    with pytest.raises(ProfileError, match="cannot read step log"):
        read_step_log(tmp_path / "missing.jsonl")
    path.write_text(json.dumps({**HEADER, "dtype": "int8"}) + "\n")
    with pytest.raises(ProfileError, match="dtype 'int8' unknown"):
        calibrate_vllm([path])


def test_a_gzipped_log_reads_as_the_plain_one(tmp_path):
    import gzip

    _write_log(tmp_path / "steps.jsonl", _truth(), num_steps=60)
    (tmp_path / "steps.jsonl.gz").write_bytes(gzip.compress((tmp_path / "steps.jsonl").read_bytes()))
    plain, packed = read_step_log(tmp_path / "steps.jsonl"), read_step_log(tmp_path / "steps.jsonl.gz")
    assert (packed.header, packed.steps) == (plain.header, plain.steps)
