"""Parity workloads: the bundled ones are valid and regenerate byte for byte; bad files are
refused naming the field."""

from __future__ import annotations

import json

import pytest

from preempt.parity.bundled import bundled_workloads
from preempt.parity.workload import BUNDLED_DIR, WorkloadError, bundled_names, load_workload, parse_workload

ONE = [{"id": 0, "prompt_tokens": 4, "output_tokens": 4}]
BASE = {"block_size": 16, "num_gpu_blocks": 9, "max_num_seqs": 4, "max_num_batched_tokens": 64}


def test_bundled_workloads_are_what_the_generator_writes():
    generated = bundled_workloads()
    assert sorted(generated) == bundled_names()
    assert len(generated) >= 6
    for name, data in generated.items():
        assert (BUNDLED_DIR / f"{name}.json").read_text() == json.dumps(data, indent=1) + "\n"
        assert load_workload(name).name == name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"requests": [{"id": 0, "prompt_tokens": 0, "output_tokens": 4}]}, "requests.0.prompt_tokens"),
        ({"requests": [{"id": 0, "prompt_tokens": 4, "output_tokens": 4, "colour": 1}]}, "unknown field"),
        ({"requests": []}, "field 'requests'"),
        ({"max_num_seqs": 128, "requests": ONE}, "max_num_batched_tokens .* must be >= max_num_seqs"),
        ({"num_gpu_blocks": 2, "requests": [{"id": 0, "prompt_tokens": 40, "output_tokens": 4}]}, "usable"),
        (
            {"max_model_len": 40, "requests": [{"id": 0, "prompt_tokens": 36, "output_tokens": 4}]},
            "max_model_len",
        ),
        (
            {"policy": "lifo", "requests": [{"id": 0, "prompt_tokens": 4, "output_tokens": 4}]},
            "field 'policy'",
        ),
        (
            {"requests": [{"id": 1, "prompt_tokens": 4, "output_tokens": 4}] * 2},
            "request id 1 appears twice",
        ),
    ],
)
def test_bad_workloads_are_refused_naming_the_field(change, message):
    with pytest.raises(WorkloadError, match=message):
        parse_workload({**BASE, **change})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(WorkloadError, match="not found.*bundled: "):
        load_workload(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadError, match="not valid json"):
        load_workload(bad)
    good = tmp_path / "mine.yaml"
    good.write_text(
        "block_size: 16\nnum_gpu_blocks: 9\nmax_num_seqs: 2\nmax_num_batched_tokens: 32\n"
        "requests:\n  - {id: 3, prompt_tokens: 20, output_tokens: 5}\n"
    )
    workload = load_workload(good)
    assert workload.name == "mine" and workload.usable_blocks == 8 and workload.requests[0].arrival_step == 0
