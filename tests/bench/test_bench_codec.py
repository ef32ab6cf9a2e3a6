"""`preempt bench codec`: the quality protocol itself is sound: a lossless plan through
save -> codec -> restore -> warm-up reproduces the unpreempted generation exactly, and the
lossy plans report sizes that follow from their plans."""

from __future__ import annotations

import torch

from preempt.bench.codec import bench_codec


def test_codec_bench_reports_every_plan_and_lossless_fp16_changes_nothing():
    result = bench_codec(quick=True)
    plans = result["plans"]
    assert {"fp16", "fp8", "random", "kivi4", "kivi_k5v4", "fp8_token"} <= set(plans)
    assert not any(name.startswith("budget_") for name in plans)  # budget plans need a trained LM
    fp16 = plans["fp16"]
    assert fp16["greedy_agreement"] == fp16["prefix_match"] == fp16["top1_agreement"] == 1.0
    # Not exactly 0: the warm-up recomputes 3 tokens as one chunk where the reference ran
    # them one by one, and float32 sums in another order.
    assert fp16["kl_mean"] < 1e-9
    assert 0.5 < plans["fp8"]["size_vs_fp16"] < 0.501 and plans["fp8"]["blob_vs_raw"] < 0.26  # float32 cache
    assert plans["fp8"]["kl_mean"] > 1e-6  # lossy: the distributions moved, however little
    for row in plans.values():  # per prompt, for a judge to pair plans prompt by prompt
        assert set(row["per_prompt"]) == {"greedy_agreement", "kl_mean", "top1_agreement"}
        for key, values in row["per_prompt"].items():
            assert len(values) == 4  # quick: 4 prompts
            assert abs(sum(values) / len(values) - row[key]) <= 1e-3 * max(abs(row[key]), 1e-9) + 1e-6
    assert plans["fp16"]["per_prompt"]["greedy_agreement"] == [1.0] * 4
    for row in plans.values():
        assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
        assert row["encode_vs_clone_long"] > 0 and row["clone_mb_s_long"] > 0  # both request sizes
    assert [s["num_tokens"] for s in result["speed_sizes"].values()] == [2048, 4096]
    assert result["cpu_threads"] == 1  # the speed columns say on how many threads
    assert "meaningless" in result["model"]  # an untrained model says so
    served = result["served_model_speed"]  # the speed columns at a real served model's KV shape
    assert (served["num_layers"], served["num_kv_heads"], served["head_dim"]) == (32, 8, 128)
    assert served["kv_dtype"] == "bfloat16" and served["cpu_threads"] == 1
    assert list(served["sizes"]) == ["256"]  # quick: one small length
    size = served["sizes"]["256"]
    assert size["kv_mb"] == round(32 * 2 * 256 * 8 * 128 * 2 / 1e6, 1)
    assert set(size["plans"]) == {"fp8", "kivi4", "kivi_k5v4", "kivi_k6v4"}  # no budget plan untrained
    for label, row in size["plans"].items():
        assert row["classes"] == {label: 256}
        assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0 and row["clone_mb_s"] > 0
        assert row["encode_vs_clone"] > 0 and row["decode_vs_clone"] > 0
    assert size["plans"]["kivi4"]["size_vs_fp16"] < size["plans"]["kivi_k6v4"]["size_vs_fp16"] < 0.5


def test_budget_plan_tiles_over_a_served_models_heads_with_its_class_shares():
    import numpy as np

    from preempt.bench.codec import _tile_plan
    from preempt.kernels.plan import HeadPlan

    codes = np.array([[4, 6, 6, 7], [4, 4, 8, 6], [6, 7, 4, 6], [7, 4, 6, 7]])
    plan = HeadPlan.from_codes(codes, "s", (64, 4, 8))
    tiled = _tile_plan(plan, 32, 8)
    assert tiled.codes().shape == (32, 8) and tiled.params() == plan.params()
    for cls in set(plan.codes().ravel()):
        assert (tiled.codes() == cls).sum() == 16 * (plan.codes() == cls).sum()  # 8 x 2 copies
    assert (tiled.codes()[4:8, 4:8] == plan.codes()).all()
    cropped = _tile_plan(plan, 6, 3)  # not a multiple: the grid cropped
    assert (cropped.codes()[4:6] == plan.codes()[:2, :3]).all()


def test_served_kv_has_outlier_key_channels_and_is_seeded():
    from preempt.bench.codec import _served_kv

    kv = _served_kv(2, 3, 16, 64)
    assert kv.shape == (2, 2, 64, 3, 16) and kv.dtype.itemsize == 2
    assert torch.equal(kv, _served_kv(2, 3, 16, 64))
    key_spread = kv[:, 0].float().std(dim=1)  # (L, H, D): per channel over tokens
    value_spread = kv[:, 1].float().std(dim=1)
    assert key_spread.amax() > 5 * value_spread.amax()  # the x10 channels stand out in keys


def test_the_served_model_speed_section_can_be_skipped():
    assert "served_model_speed" not in bench_codec(quick=True, served_speed=False)


def test_the_budget_summary_leaves_the_verdict_to_the_claims_report():
    from preempt.bench.codec import _budget_summary

    def row(agreement: float, kl: float) -> dict:
        return {"greedy_agreement": agreement, "kl_mean": kl, "top1_agreement": 0.97, "size_vs_fp16": 0.348}

    rows = {"fp8": row(0.5, 0.003), "budget_sensitivity": row(0.6, 0.002)}
    rows |= {f"budget_random_s{seed}": row(0.4 + seed / 100, 0.004) for seed in range(3)}
    summary = _budget_summary(rows)
    assert "sensitivity_meets_target" not in summary  # a boolean of means flipped with the prompts
    assert "preempt report --codec" in summary["sensitivity_vs_fp8"]
    assert summary["random_greedy_agreement"]["max"] == 0.42
