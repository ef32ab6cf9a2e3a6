"""`preempt bench codec`: the quality protocol itself is sound: a lossless plan through
save -> codec -> restore -> warm-up reproduces the unpreempted generation exactly, and the
lossy plans report sizes that follow from their plans."""

from __future__ import annotations

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
    for row in plans.values():
        assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
        assert row["encode_vs_clone_long"] > 0 and row["clone_mb_s_long"] > 0  # both request sizes
    assert [s["num_tokens"] for s in result["speed_sizes"].values()] == [2048, 4096]
    assert result["cpu_threads"] == 1  # the speed columns say on how many threads
    assert "meaningless" in result["model"]  # an untrained model says so
