import json

import numpy as np
import pytest

from preempt.calibrate import fit, vidur
from preempt.cli import main
from preempt.core.config import ConfigError
from preempt.core.config_files import load_config
from preempt.core.cost_model import CostModel, StepShape
from preempt.core.profiles import MODELS, ProfileError, TargetProfile, get_target, load_device, load_target


def _known_device():
    data = load_device("h100").to_dict()
    data.update(
        linear_flops_per_s=6.0e14, linear_bytes_per_s=2.7e12, linear_exponent=3.0, linear_floor_s=4e-6
    )
    data.update(attn_kv_bytes_per_s=2.0e12, attn_flops_per_s=2.5e14, attn_exponent=2.5, attn_floor_s=1.8e-5)
    data.update(attn_per_row_head_s=2e-9, attn_masked_share=1.0)
    data["op_tables"] = {}  # the formula alone generates the synthetic points
    return type(load_device("h100")).from_dict(data)


def test_fit_recovers_known_constants_from_synthetic_data():
    device = _known_device()
    points = []
    for tp in (1, 2, 4):
        cost = CostModel(TargetProfile("synthetic", MODELS["llama2-7b"], tp, device))
        for t in (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096):
            for op, seconds in cost.layer_linear_s(t).items():
                points.append(vidur.OpPoint("x", "llama2-7b", tp, op, t, seconds))
    got = fit.fit_linear(points)
    for key in ("linear_flops_per_s", "linear_bytes_per_s", "linear_exponent", "linear_floor_s"):
        assert got[key] == pytest.approx(getattr(device, key), rel=0.01), key

    cost = CostModel(TargetProfile("synthetic", MODELS["llama3-70b"], 2, device))
    attn = [
        vidur.AttnPoint("x", 64, 8, 128, 2, False, b, kv, 0, 0.0)
        for b in (1, 8, 64, 128)
        for kv in (32, 512, 4096)
    ] + [
        vidur.AttnPoint("x", 64, 8, 128, 2, True, 1, kv, c, 0.0)
        for c in (4, 8, 16, 32, 64, 512, 4096)
        for kv in (0, 1024, 4032)
    ]
    attn = [
        p._replace(
            measured_s=cost.attention_s(p.sum_attn_ctx, p.sum_kv_read, p.prefill_rows, p.sum_masked_ctx)
        )
        for p in attn
    ]
    got = fit.fit_attention(attn)
    for key in fit.ATTN_KEYS:
        assert got[key] == pytest.approx(getattr(device, key), rel=0.02), key

    # elementwise: a wide row whose width the TP shards vary (SiLU*mul) recovers all four
    # constants; a row of one width (RMSNorm) has no row term to find: 0
    known = {"mlp_act": (2e-6, 1.5e12, 1e-10, 3.0), "input_layernorm": (3e-6, 1.2e12, 0.0, 4.0)}
    device = type(device).from_dict({**device.to_dict(), "elementwise": {**device.elementwise, **known}})
    for op, constants in known.items():
        points = []
        for tp in (1, 2, 4, 8):
            cost = CostModel(TargetProfile("synthetic", MODELS["llama2-7b"], tp, device))
            for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
                points.append(vidur.OpPoint("x", "llama2-7b", tp, op, t, cost.elementwise_s(op, t)))
        assert fit.fit_elementwise(points) == pytest.approx(constants, rel=0.02, abs=1e-14), op

    sizes = np.geomspace(1e3, 6e7, 20).astype(int)
    latency, rate = device.all_reduce[4]
    reduce = [vidur.AllReducePoint("x", 4, int(s), latency + 2 * s / rate) for s in sizes]
    assert fit.fit_all_reduce(reduce) == pytest.approx((latency, rate), rel=1e-3)


def test_bundled_profiles_are_the_fit_of_the_bundled_data():
    # The committed JSONs must be what `preempt calibrate --from vidur` writes (deterministic).
    for name, device in fit.fit_vidur().items():
        bundled = load_device(name)
        assert bundled.linear_flops_per_s == pytest.approx(device.linear_flops_per_s, rel=1e-9)
        assert bundled.attn_floor_s == pytest.approx(device.attn_floor_s, rel=1e-9)
        assert bundled.all_reduce.keys() == device.all_reduce.keys()
        assert bundled.op_tables == device.op_tables
    h100, h200 = load_device("h100"), load_device("h200")
    assert h200.linear_flops_per_s == h100.linear_flops_per_s  # same compute die
    assert h200.linear_bytes_per_s == pytest.approx(h100.linear_bytes_per_s * 4.8 / 3.35)
    # Measured tables belong to the GPU that was measured: the H200 is derived, so none.
    assert h200.op_tables == {} and "llama2-7b/tp4" in h100.op_tables
    ops = [
        p for p in vidur.load_ops() if (p.gpu, p.model, p.tp, p.op) == ("h100", "llama2-7b", 4, "mlp_up_proj")
    ]
    tokens, seconds = h100.op_tables["llama2-7b/tp4"]["mlp_up_proj"]
    assert tokens == tuple(sorted(p.num_tokens for p in ops))
    assert seconds == pytest.approx([p.measured_s for p in sorted(ops, key=lambda p: p.num_tokens)], rel=1e-3)


def test_a_gpu_calibration_of_a_known_model_shape_writes_its_op_tables():
    from preempt.calibrate.gpu import LLAMA3_8B, TINY

    assert fit._model_named(LLAMA3_8B) == "llama3-8b" and fit._model_named(TINY) is None
    # a synthetic measurement at Llama-3-8B's shape: the formula's own times, doubled
    device = load_device("h200")
    cost = CostModel(TargetProfile("x", MODELS["llama3-8b"], 1, device))
    tokens = (1, 16, 256, 4096)
    data = {
        "device": "synthetic",
        "dtype": "bfloat16",
        "shape": LLAMA3_8B,
        "linear": [
            [op, t, k, n, 2 * cost.linear_s(t, k, n)] for op, k, n in cost._layer_gemms for t in tokens
        ],
        "lm_head": [[t, 4096, 128256, cost.linear_s(t, 4096, 128256)] for t in (1, 64)],
        "elementwise": [
            [op, t, 2 * cost.elementwise_s(op, t)]
            for op in ("input_layernorm", "mlp_act", "add", "attn_rope")
            for t in tokens
        ],
        "attention": [
            {
                "is_prefill": False,
                "batch_size": b,
                "kv_cache_size": c,
                "prefill_chunk_size": 0,
                "seconds": 1e-5 * b * c / 128,
            }
            for b in (1, 16)
            for c in (128, 2048)
        ]
        + [
            {
                "is_prefill": True,
                "batch_size": 1,
                "kv_cache_size": 0,
                "prefill_chunk_size": c,
                "seconds": 1e-5 * c / 16,
            }
            for c in (128, 2048)
        ],
        "copies": [
            {"bytes": b, "d2h_s": 1e-5 + b / 5e10, "h2d_s": 1e-5 + b / 5e10, "both_s": 1e-5 + b / 4e10}
            for b in (2**16, 2**24)
        ],
        "memory": None,
    }
    measured = fit.fit_measurements(data, device, name="m")
    assert set(measured.op_tables) == {"llama3-8b/tp1"}
    assert set(measured.op_tables["llama3-8b/tp1"]) == {
        "attn_pre_proj",
        "attn_post_proj",
        "mlp_up_proj",
        "mlp_down_proj",
        "input_layernorm",
        "post_attention_layernorm",
        "mlp_act",
        "add",
        "attn_rope",
    }
    tabled = CostModel(TargetProfile("x", MODELS["llama3-8b"], 1, measured))
    for t in tokens:  # the measured times come back at the measured counts
        assert tabled.layer_linear_s(t)["mlp_up_proj"] == pytest.approx(
            2 * cost.layer_linear_s(t)["mlp_up_proj"], rel=1e-3
        )
        assert tabled.elementwise_s("add", t) == pytest.approx(2 * cost.elementwise_s("add", t), rel=1e-3)


def test_a_profile_missing_a_field_is_refused_by_name(tmp_path):
    data = {"kind": "device", "device": load_device("h200").to_dict()}
    del data["device"]["attn_floor_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="missing field 'attn_floor_s'"):
        load_target(path)
    with pytest.raises(ConfigError, match="attn_floor_s"):
        load_config(None, [f"clock.target={path}"])
    data["device"]["attn_floor_s"] = 1e-5
    for new_field in ("attn_per_row_head_s", "attn_masked_share"):  # profiles older than these terms
        value = data["device"].pop(new_field)
        path.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=f"missing field '{new_field}'"):
            load_target(path)
        data["device"][new_field] = value
    data["device"]["attn_masked_share"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="attn_masked_share: a share"):
        load_target(path)
    data["device"]["attn_masked_share"] = 1.0
    data["device"]["elementwise"]["add"] = [1e-6, 1e12]  # before the row term: refit, says so
    path.write_text(json.dumps(data))
    with pytest.raises(
        ProfileError, match=r"elementwise.add: expected \[floor_s, bytes_per_s, row_s_per_byte"
    ):
        load_target(path)
    data["device"]["elementwise"]["add"] = [1e-6]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="elementwise.add"):
        load_target(path)
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"model": "llama3-70b", "device": "h200"}))
    with pytest.raises(ProfileError, match="missing field 'num_gpus'"):
        load_target(target)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        get_target(str(path))


def test_a_target_file_names_model_gpus_and_device(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"name": "mine", "model": "llama3-70b", "num_gpus": 4, "device": "h200"}))
    assert CostModel(load_target(path)).step_time_s(StepShape(8, 4000, 4000, 8)) == CostModel(
        get_target("4xh200-llama3-70b")
    ).step_time_s(StepShape(8, 4000, 4000, 8))


def test_calibrate_device_runs_end_to_end_with_tiny(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--device", "cuda", "--tiny", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["kind"] == "device" and written["measurements"]["linear"]
    assert written["device"]["op_tables"] == {}  # the toy shape is no bundled model's
    target = load_target(out)
    assert target.device.sources["linear_flops_per_s"].startswith("fit: measured")
    assert CostModel(target).step_time_s(StepShape(4, 100, 100, 4)) > 0
    # and a measurement file can be refitted later
    again = tmp_path / "again.json"
    assert main(["calibrate", "--from", str(out), "--out", str(again)]) == 0
    assert load_target(again).device.linear_floor_s == pytest.approx(target.device.linear_floor_s)


def test_calibrate_refuses_bad_input_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"device": "x"}))
    assert main(["calibrate", "--from", str(bad), "--out", str(tmp_path / "o.json")]) == 2
    assert "missing field 'dtype'" in capsys.readouterr().err
