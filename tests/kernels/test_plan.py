"""HeadPlan: constructors, counts and slots, JSON round trip and validation, sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from preempt.kernels.plan import HeadClass, HeadPlan, bytes_per_token, scale_bytes
from preempt.kv.kv_cache import KVCache

FP16, FP8, DROP = HeadClass.FP16, HeadClass.FP8, HeadClass.DROP


def test_uniform_plans_and_counts():
    plan = HeadPlan.all_fp8(3, 4)
    assert (plan.num_layers, plan.num_kv_heads) == (3, 4)
    assert (plan.num_fp16, plan.num_fp8, plan.num_drop) == (0, 12, 0)
    assert HeadPlan.all_fp16(2, 2).codes().tolist() == [[0, 0], [0, 0]]
    assert HeadPlan.uniform(1, 3, DROP).dropped_mask().tolist() == [[True, True, True]]


def test_slots_are_row_major_within_each_class():
    plan = HeadPlan.from_codes([[FP8, FP16, DROP], [FP16, FP8, FP8]])
    assert plan.slot_index().tolist() == [[0, 0, -1], [1, 1, 2]]
    layers, heads = plan.heads_of(FP8)
    assert list(zip(layers.tolist(), heads.tolist(), strict=True)) == [(0, 0), (1, 1), (1, 2)]


def test_plan_is_frozen_and_hashable():
    plan = HeadPlan.all_fp16(2, 2)
    assert hash(plan) == hash(HeadPlan.all_fp16(2, 2)) and plan == HeadPlan.all_fp16(2, 2)
    with pytest.raises(AttributeError):
        plan.classes = ()  # type: ignore[misc]


def test_random_plan_has_exact_shares_and_is_seeded():
    plan = HeadPlan.random(8, 5, fp8_share=0.5, drop_share=0.1, seed=3)
    assert (plan.num_drop, plan.num_fp8, plan.num_fp16) == (4, 20, 16)
    assert plan == HeadPlan.random(8, 5, fp8_share=0.5, drop_share=0.1, seed=3)
    assert plan != HeadPlan.random(8, 5, fp8_share=0.5, drop_share=0.1, seed=4)
    with pytest.raises(ValueError, match="<= 1"):
        HeadPlan.random(2, 2, fp8_share=0.8, drop_share=0.3, seed=0)
    with pytest.raises(ValueError, match="drop_share"):
        HeadPlan.random(2, 2, fp8_share=0.1, drop_share=-0.1, seed=0)


def test_importance_plan_drops_the_least_important():
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.05]])
    plan = HeadPlan.from_importance(scores, fp8_share=1 / 3, drop_share=1 / 3)
    assert plan.codes().tolist() == [[FP16, DROP, FP8], [FP8, FP16, DROP]]
    with pytest.raises(ValueError, match="finite"):
        HeadPlan.from_importance(np.array([[np.nan]]), fp8_share=0, drop_share=0)


def test_json_round_trip(tmp_path):
    plan = HeadPlan.random(4, 3, fp8_share=0.5, drop_share=0.25, seed=1)
    assert HeadPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert HeadPlan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["format"] == "preempt-head-plan" and data["layers"][0] == [c.label for c in plan.classes[0]]
    assert data["source"].startswith("random")


def _plan_dict(**changes):
    data = {
        "format": "preempt-head-plan",
        "version": 1,
        "num_layers": 2,
        "num_kv_heads": 2,
        "layers": [["fp16", "fp8"], ["drop", "fp16"]],
    }
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": [["fp16", "fp8"], ["drop", "int4"]]}, r"layer 1 head 1: unknown class 'int4'"),
        ({"layers": [["fp16", "fp8"]]}, r"'layers' has 1 rows, 'num_layers' says 2"),
        ({"layers": [["fp16", "fp8"], ["drop"]]}, r"layer 1 has 1 heads, 'num_kv_heads' says 2"),
        ({"version": 3}, r"'version' is 3"),
        ({"layers": [["fp16", "kivi4"], ["drop", "fp16"]]}, r"class 'kivi4' needs 'version' 2"),
        ({"version": 2, "num_sink": -1}, r"'num_sink' must be an integer >= 0"),
        ({"format": "other"}, r"'format' is 'other'"),
        ({"num_layers": 0}, r"'num_layers' must be a positive integer"),
        ({"heads": 1}, r"unknown key\(s\) \['heads'\]"),
        ({"source": 3}, r"'source' must be a string"),
    ],
)
def test_bad_plans_are_value_errors_naming_the_problem(changes, message):
    with pytest.raises(ValueError, match=message):
        HeadPlan.from_dict(_plan_dict(**changes))


def test_bad_plan_files_name_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON"):
        HeadPlan.load(path)
    data = _plan_dict()
    del data["layers"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"broken.json: missing key\(s\) \['layers'\]"):
        HeadPlan.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        HeadPlan.load(tmp_path / "absent.json")


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="layer 1 has 1 KV heads"):
        HeadPlan(((FP16, FP8), (FP16,)))
    with pytest.raises(ValueError, match="not a HeadClass"):
        HeadPlan(((FP16, 1),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown head class code 42"):
        HeadPlan.from_codes([[0, 42]])


def test_check_shape_names_both_shapes():
    with pytest.raises(ValueError, match="2 layers x 2 KV heads, the KV cache has 2 x 4"):
        HeadPlan.all_fp16(2, 2).check_shape(2, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bytes_per_token(dtype):
    cache = KVCache(3, 1, 1, 4, 16, dtype)
    assert bytes_per_token(HeadPlan.all_fp16(3, 4), 16, dtype) == cache.bytes_per_token
    assert bytes_per_token(HeadPlan.all_fp8(3, 4), 16, dtype) == 3 * 2 * 4 * 16
    plan = HeadPlan.from_codes([[FP16, FP8, DROP, DROP]] * 3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert bytes_per_token(plan, 16, dtype) == 3 * 2 * 16 * (itemsize + 1)
    assert scale_bytes(plan) == 3 * 2 * 4
