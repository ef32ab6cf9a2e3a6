"""`preempt calibrate --device cuda`: measure the cost model's operators on this GPU.

Owns: the measurement protocol. A random-weight Llama-3-8B-shaped stack in bf16 (no
download): the four GEMMs of a layer over 164 token counts (1..8192; each point 8 calls
back to back in one CUDA graph, timed as one, so neither launches nor the timing events
are measured instead of the kernel),
the LM head, the elementwise kernels, attention decode (batch x context) and prefill
(chunk x prior context) through SDPA, pinned device->host / host->device / both-ways
copies from 64 KB to 256 MB, and the memory left for KV. Imports torch and the standard
library only (the GPU machine may lack the rest); `fit_measurements` (numpy) turns the
result into a device profile (constants + measured op tables), here or later with
`preempt calibrate --from FILE`.
Budget: 45 s on one H200, measured 2026-12-04 (each point the median of 10 timed graphs).
`--tiny`: a toy shape and few points, so the code path runs on CPU in seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

LLAMA3_8B = dict(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
TINY = dict(hidden=256, q_heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1024)

# Token counts for the GEMMs and elementwise kernels: nearly as dense as Vidur's profiles
# (every 16 tokens to 1024, then 32/64/128 apart), because cuBLAS's tile choices make the
# times step between counts and the profile's op tables interpolate between them;
# `preempt bench clock` (`calibration_grid`) scores this grid on Vidur's points.
GRID_TOKENS = [
    1,
    2,
    4,
    8,
    *range(16, 1025, 16),
    *range(1056, 2049, 32),
    *range(2112, 4097, 64),
    *range(4224, 8193, 128),
]
FULL_GRID = dict(
    tokens=GRID_TOKENS,
    lm_head_tokens=[1, 8, 32, 64, 128, 256],
    decode_batch=[1, 4, 16, 64, 256],
    decode_ctx=[128, 512, 2048, 8192],
    prefill_chunk=[128, 512, 2048, 8192],
    prefill_prior=[0, 2048, 8192],
    copy_bytes=[2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28],
    reps=10,
)
TINY_GRID = dict(
    tokens=[1, 4, 16, 64],
    lm_head_tokens=[1, 8],
    decode_batch=[1, 4],
    decode_ctx=[32, 128],
    prefill_chunk=[16, 64],
    prefill_prior=[0, 64],
    copy_bytes=[2**16, 2**20],
    reps=3,
)


class _Timer:
    """Median seconds of one call of `fn` on `device`: on CUDA, `INNER` back-to-back calls
    timed as one between two events (inside one CUDA graph where `graph`, so no launch gap
    either), divided by `INNER`; on CPU, one call by perf_counter.

    Why not one call per pair of events: that puts a floor of ~15 us under every point, the
    events' and the launch's own time (the first H200 run, 2026-12-04: a one-token residual
    add read 15.6 us, docs/gpu.md), and beyond the graphed sizes the launch gaps between an
    op's kernels were measured instead of the kernels."""

    INNER = 8

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps
        self.is_cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], graph: bool = True) -> float:
        if not self.is_cuda:
            fn()  # warm-up
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        run = self._graphed(fn) if graph else None
        if run is None:  # not asked for, or the op cannot be captured

            def run() -> None:
                for _ in range(self.INNER):
                    fn()

        run()  # warm-up (kernel selection, allocator)
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / self.INNER)
        return statistics.median(times)

    def _graphed(self, fn: Callable[[], Any]) -> Callable[[], Any] | None:
        """A CUDA graph of `INNER` calls of `fn` (its replay), or None if `fn` cannot be
        captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the graph, as CUDA graph capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(self.INNER):
                    fn()
        except RuntimeError:
            torch.cuda.synchronize()
            return None
        return graph.replay


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # torch's own RMSNorm where it has one (a fused kernel on CUDA in recent versions; the
    # composite below is five or more kernels, each a pass over x)
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w


def _rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half], q[..., half:]
    return torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)


def _measure_copies(timer: _Timer, dev: torch.device, nbytes: int) -> dict[str, float]:
    """Pinned device->host, host->device, and both at once on two streams."""
    n = nbytes // 2
    pin = dev.type == "cuda"
    src_d = torch.empty(n, device=dev, dtype=torch.float16)
    dst_d = torch.empty(n, device=dev, dtype=torch.float16)
    host_a = torch.empty(n, dtype=torch.float16, pin_memory=pin)
    host_b = torch.empty(n, dtype=torch.float16, pin_memory=pin)
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if pin else None

    def d2h() -> None:
        host_a.copy_(src_d, non_blocking=True)

    def h2d() -> None:
        dst_d.copy_(host_b, non_blocking=True)

    def both() -> None:
        if streams is None:
            d2h()
            h2d()
            return
        for stream, copy in zip(streams, (d2h, h2d), strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                copy()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)

    # eager: back-to-back copies on the link (two streams for `both`, not captured)
    return {
        "bytes": nbytes,
        "d2h_s": timer(d2h, graph=False),
        "h2d_s": timer(h2d, graph=False),
        "both_s": timer(both, graph=False),
    }


def _prefill_mask(out: dict[str, Any], chunk: int, prior: int, dev: torch.device) -> Any:
    """`causal_lower_right` where this torch has it and SDPA takes it with GQA, else the
    explicit mask; `out["prefill_mask"]` records which (the fit's masked-pair share)."""
    if out["prefill_mask"] == "causal_lower_right":
        try:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(chunk, prior + chunk)
            q, kv = torch.zeros(1, 2, chunk, 8, device=dev), torch.zeros(1, 1, prior + chunk, 8, device=dev)
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=bias, enable_gqa=True)  # a probe
            return bias
        except (ImportError, RuntimeError, TypeError, ValueError):
            out["prefill_mask"] = "explicit"
    return torch.ones(chunk, prior + chunk, device=dev, dtype=torch.bool).tril(diagonal=prior)


def measure(device: str = "cuda", tiny: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every measurement; returns plain data (JSON-ready)."""
    dev = torch.device(device)
    shape, grid = (TINY, TINY_GRID) if tiny else (LLAMA3_8B, FULL_GRID)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU bf16 GEMMs are emulated
    timer = _Timer(dev, grid["reps"])
    torch.manual_seed(0)
    h, d, hq, hkv, inter = (
        shape["hidden"],
        shape["head_dim"],
        shape["q_heads"],
        shape["kv_heads"],
        shape["intermediate"],
    )
    gemms = {
        "attn_pre_proj": (h, (hq + 2 * hkv) * d),
        "attn_post_proj": (hq * d, h),
        "mlp_up_proj": (h, 2 * inter),
        "mlp_down_proj": (inter, h),
    }
    started = time.perf_counter()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "torch": torch.__version__,
        # how each point was timed, and which RMSNorm ran (torch's own, or the composite)
        "timing": f"{_Timer.INNER} calls per CUDA graph (copies: eager), median of {grid['reps']}",
        "rmsnorm": "F.rms_norm" if hasattr(F, "rms_norm") else "composite",
    }
    weights = {op: torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k) for op, (k, n) in gemms.items()}
    max_t = max(grid["tokens"])
    x_full = torch.randn(max_t, max(h, inter, hq * d), device=dev, dtype=dtype)
    linear = []
    for t in grid["tokens"]:
        for op, (k, n) in gemms.items():
            x = x_full[:t, :k].contiguous()
            w = weights[op]
            linear.append([op, t, k, n, timer(lambda x=x, w=w: F.linear(x, w))])
    out["linear"] = linear
    log(f"linear: {len(linear)} points ({time.perf_counter() - started:.0f} s)")

    lm_w = torch.randn(shape["vocab"], h, device=dev, dtype=dtype) / math.sqrt(h)
    out["lm_head"] = []
    for t in grid["lm_head_tokens"]:
        x = x_full[:t, :h].contiguous()
        out["lm_head"].append([t, h, shape["vocab"], timer(lambda x=x, w=lm_w: F.linear(x, w))])
    del lm_w

    elementwise = []
    norm_w = torch.ones(h, device=dev, dtype=dtype)
    for t in grid["tokens"]:
        x = x_full[:t, :h].contiguous()
        gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dtype)
        qk = torch.randn(t, hq + hkv, d, device=dev, dtype=dtype)
        cos = torch.randn(t, 1, d // 2, device=dev, dtype=dtype)
        sin = torch.randn(t, 1, d // 2, device=dev, dtype=dtype)
        elementwise += [
            ["input_layernorm", t, timer(lambda x=x: _rmsnorm(x, norm_w))],
            ["mlp_act", t, timer(lambda g=gate_up: F.silu(g[:, :inter]) * g[:, inter:])],
            ["add", t, timer(lambda x=x: x + x)],
            ["attn_rope", t, timer(lambda q=qk, c=cos, s=sin: _rope(q, c, s))],
        ]
    out["elementwise"] = elementwise
    log(f"elementwise: {len(elementwise)} points ({time.perf_counter() - started:.0f} s)")

    attention = []
    for b in grid["decode_batch"]:
        for ctx in grid["decode_ctx"]:
            if b * ctx * hkv * d * 2 * 2 > 8 * 2**30:  # skip shapes over 8 GiB of KV
                continue
            q = torch.randn(b, hq, 1, d, device=dev, dtype=dtype)
            kv = torch.randn(2, b, hkv, ctx, d, device=dev, dtype=dtype)
            sec = timer(lambda q=q, kv=kv: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True))
            attention.append(
                {
                    "is_prefill": False,
                    "batch_size": b,
                    "kv_cache_size": ctx,
                    "prefill_chunk_size": 0,
                    "seconds": sec,
                }
            )
            del q, kv
    out["prefill_mask"] = "causal_lower_right"
    for c in grid["prefill_chunk"]:
        for prior in grid["prefill_prior"]:
            q = torch.randn(1, hq, c, d, device=dev, dtype=dtype)
            kv = torch.randn(2, 1, hkv, prior + c, d, device=dev, dtype=dtype)
            # causal with an offset: query i sees keys [0, prior + i]. Lower-right causal
            # lets SDPA pick a flash kernel, which skips the masked tiles as served kernels
            # do; an explicit boolean mask (the fallback) makes it compute every pair.
            mask = _prefill_mask(out, c, prior, dev)
            sec = timer(
                lambda q=q, kv=kv, m=mask: F.scaled_dot_product_attention(
                    q, kv[0], kv[1], attn_mask=m, enable_gqa=True
                )
            )
            attention.append(
                {
                    "is_prefill": True,
                    "batch_size": 1,
                    "kv_cache_size": prior,
                    "prefill_chunk_size": c,
                    "seconds": sec,
                }
            )
            del q, kv, mask
    out["attention"] = attention
    log(f"attention: {len(attention)} points ({time.perf_counter() - started:.0f} s)")

    copies = [_measure_copies(timer, dev, nbytes) for nbytes in grid["copy_bytes"]]
    out["copies"] = copies
    log(f"copies: {len(copies)} sizes ({time.perf_counter() - started:.0f} s)")

    del weights, x_full
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        out["memory"] = {"total_bytes": total, "free_bytes": free}
    else:
        out["memory"] = None
    out["seconds"] = time.perf_counter() - started
    return out
