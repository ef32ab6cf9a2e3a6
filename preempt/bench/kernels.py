"""`preempt bench kernels`: the save path's Triton kernels on a GPU (CUDA only).

On a Llama-3-8B-shaped paged cache (32 layers, 8 KV heads, head_dim 128, bf16, blocks of
16 tokens, scattered block ids), one request of `num_tokens`:

- Bandwidth of `gather_blocks` (raw), `gather_quantize_heads` (the design's mixed plan:
  40% FP16, 50% FP8, 10% dropped) and `restore_blocks`, as bytes read + written over
  kernel time, and as a fraction of the device's HBM peak (`--hbm-tb-s`, default the
  H200's 4.8 TB/s). Target: >= 60% for gather + quantize.
- End-to-end save to pinned host memory: gather + quantize + a device-to-host copy of the
  packed bytes, against the PCIe copy of the raw bytes alone (what `swap` pays), in the
  same run.

CUDA events time each call (median of `repeats` after warm-up). Without CUDA it returns
`{"skipped": ...}`: the kernels' correctness on CPU is covered by the interpreter tests.
"""

from __future__ import annotations

from typing import Any

import torch

H200_HBM_TB_S = 4.8


def bench_kernels(quick: bool, hbm_tb_s: float = H200_HBM_TB_S) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA device (kernels are checked on CPU by the TRITON_INTERPRET tests)"}
    from preempt.kernels.gather_blocks import gather_blocks
    from preempt.kernels.plan import HeadPlan
    from preempt.kernels.quantize_heads import gather_quantize_heads
    from preempt.kernels.restore_blocks import restore_blocks

    num_layers, num_heads, head_dim, block_size = 32, 8, 128, 16
    num_tokens = 2048 if quick else 8192
    repeats = 5 if quick else 20
    num_blocks = 4 * num_tokens // block_size
    device = torch.device("cuda")
    cache = torch.randn(
        num_layers, 2, num_blocks, block_size, num_heads, head_dim, dtype=torch.bfloat16, device=device
    )
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(num_blocks, generator=gen)[: num_tokens // block_size].to(device)
    plan = HeadPlan.random(num_layers, num_heads, fp8_share=0.5, drop_share=0.1, seed=0)
    raw_bytes = num_tokens * num_layers * 2 * num_heads * head_dim * 2

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        return sorted(times)[len(times) // 2]

    quantized = gather_quantize_heads(cache, block_ids, num_tokens, plan)
    packed_bytes = quantized.nbytes
    fresh = torch.randperm(num_blocks, generator=gen)[: num_tokens // block_size].to(device)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "shape": f"{num_layers} layers x {num_heads} KV heads x {head_dim}, bf16, {num_tokens} tokens",
        "raw_bytes": raw_bytes,
        "packed_bytes": packed_bytes,
        "hbm_peak_tb_s": hbm_tb_s,
    }
    for name, fn, moved in (
        ("gather_blocks", lambda: gather_blocks(cache, block_ids, num_tokens), 2 * raw_bytes),
        (
            "gather_quantize_heads",
            lambda: gather_quantize_heads(cache, block_ids, num_tokens, plan),
            # reads the kept and FP8 heads (dropped heads are never read), writes packed
            raw_bytes * (plan.num_fp16 + plan.num_fp8) / (num_layers * num_heads) + packed_bytes,
        ),
        ("restore_blocks", lambda: restore_blocks(quantized, cache, fresh), packed_bytes + raw_bytes),
    ):
        seconds = timed(fn)
        results[name] = {
            "ms": round(seconds * 1e3, 4),
            "tb_s": round(moved / seconds / 1e12, 3),
            "fraction_of_hbm_peak": round(moved / seconds / (hbm_tb_s * 1e12), 3),
        }
    pinned_raw = torch.empty(raw_bytes, dtype=torch.uint8, pin_memory=True)
    raw_view = cache.view(torch.uint8).reshape(-1)[:raw_bytes]
    pinned_packed = [
        torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
        for t in (quantized.kept, quantized.fp8, quantized.scales)
    ]

    def save_mixed() -> None:
        q = gather_quantize_heads(cache, block_ids, num_tokens, plan)
        for dst, t in zip(pinned_packed, (q.kept, q.fp8, q.scales), strict=True):
            dst.copy_(t.contiguous().view(torch.uint8).reshape(-1), non_blocking=True)

    raw_copy_s = timed(lambda: pinned_raw.copy_(raw_view, non_blocking=True))
    mixed_save_s = timed(save_mixed)
    results["save_to_pinned"] = {
        "raw_pcie_copy_ms": round(raw_copy_s * 1e3, 4),
        "raw_pcie_gb_s": round(raw_bytes / raw_copy_s / 1e9, 2),
        "mixed_save_ms": round(mixed_save_s * 1e3, 4),
        "mixed_vs_raw_copy": round(mixed_save_s / raw_copy_s, 3),
    }
    results["target_gather_quantize_ge_0.6_of_peak"] = (
        results["gather_quantize_heads"]["fraction_of_hbm_peak"] >= 0.6
    )
    return results
