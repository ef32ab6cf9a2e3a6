"""A device profile file refused field by field, the message naming the file and the field."""

import json
import re

import pytest

from preempt.core.profiles import ProfileError, get_target, load_target


def _device():
    return get_target("h200-llama3-8b").device.to_dict()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("attn_floor_s"), "p.json: device: missing field 'attn_floor_s'"),
        (lambda d: d["elementwise"].pop("emb"), "p.json: device.elementwise: missing field 'emb'"),
        (lambda d: d.update(linear_exponent="fast"), "device.linear_exponent: expected a number, got 'fast'"),
        (lambda d: d.update(linear_exponent=True), "device.linear_exponent: expected a number, got True"),
        (lambda d: d.update(linear_flops_per_s=0), "device.linear_flops_per_s: must be > 0"),
        (lambda d: d.update(copy_latency_s=-1e-6), "device.copy_latency_s: must be >= 0"),
        (lambda d: d.update(attn_masked_share=1.5), "device.attn_masked_share: a share, expected 0..1"),
        (lambda d: d["elementwise"]["add"].__setitem__(3, 0.5), "elementwise.add.3: exponent must be >= 1"),
        (lambda d: d["all_reduce"].update({"1": [1e-6, 1e9]}), "all_reduce.1: all-reduces need 2+ GPUs"),
        (lambda d: d["all_reduce"].update(four=[1e-6, 1e9]), "device.all_reduce.four: not a GPU count"),
        (lambda d: d.update(all_reduce={}), "device.all_reduce: expected an object {num_gpus"),
        (lambda d: d.update(name=""), "device.name: expected a non-empty string"),
        (lambda d: d.update(sources=[]), "device.sources: expected an object field -> source"),
    ],
)
def test_a_bad_device_field_is_named(tmp_path, change, message):
    device = _device()
    change(device)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "device", "device": device}))
    with pytest.raises(ProfileError, match=re.escape(message)):
        load_target(path)


def test_a_bad_target_field_is_named_and_unknown_fields_are_ignored(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model": "llama3-8b", "num_gpus": True, "device": "h200"}))
    with pytest.raises(ProfileError, match=re.escape("t.json: num_gpus: expected a positive integer")):
        load_target(path)
    path.write_text(json.dumps({"model": "llama3-8b", "num_gpus": 1, "device": "h200", "note": "x"}))
    assert load_target(path).device == get_target("h200-llama3-8b").device
