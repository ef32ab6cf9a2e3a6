"""`preempt bench save`: it runs against the saver's present API (it once called an older
`save(request, codec, now, record)` and failed on its first save), and what it reports
follows from what it measured."""

from __future__ import annotations

from preempt.bench.save import bench_save


def test_save_bench_runs_and_its_numbers_follow_from_the_codecs():
    result = bench_save(quick=True)
    for dtype in ("bf16", "fp32"):
        codecs = result[f"codec_throughput_{dtype}"]["codecs"]
        assert codecs["raw"]["ratio"] == 1.0  # raw stores every byte
        assert codecs["zstd"]["ratio"] > 1.0  # real KV compresses
        for row in codecs.values():
            assert row["save_mb_s"] > 0 and row["restore_mb_s"] > 0
    soak = result["soak_azure_conv_4x_null"]
    assert soak["all_final"] and soak["num_preemptions"] > 0  # the soak really preempted
    assert soak["accounting_drift"] == [] and soak["blocks_free_at_end"] and soak["host_slots_free_at_end"]
