"""`preempt bench clock`: the virtual clock's fidelity against measured GPU times.

For every measured point in the bundled Vidur profiles, predicted / measured through
`CostModel` (the same code the engine runs), by operator, by whole layer (the layer's
GEMMs + elementwise kernels at one token count), decode-like (<= 128 tokens) and
prefill-like (>= 512 tokens) shapes, attention decode/prefill and all-reduce; RMS log
error per data set, and whether the set was used in the fit. Plus a transfer check: the
H100 fit carried to the A100 by datasheet ratios (the method that gives the H200
profile), scored on the A100's measurements. And `published`: end-to-end latencies that
engines' own benchmarks published (`preempt/calibrate/data/published_e2e.csv`, held out:
nothing was fitted to them), predicted step by step through the same `CostModel`.

The analytic constants are scored without the profiles' measured operator tables
(`analytic()`), since with them a measured point is reproduced by construction. The
tables get their own check (`table_fidelity`): each point predicted from the table with
that point left out, and from a table of only the token counts `preempt calibrate
--device cuda` measures, at every other count: what a GPU calibration's table gives.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from preempt.calibrate import published, vidur
from preempt.calibrate.fit import (
    FIT_SETS,
    LINEAR_OPS,
    PROFILED_MASKED_SHARE,
    derive_device,
    measured_op_points,
    op_tables,
)
from preempt.calibrate.gpu import FULL_GRID
from preempt.core.cost_model import CostModel
from preempt.core.profiles import (
    ELEMENTWISE_OPS,
    MODELS,
    DeviceProfile,
    ProfileError,
    TargetProfile,
    load_device,
)

DECODE_MAX_TOKENS = 128
PREFILL_MIN_TOKENS = 512
# Datasheet dense bf16 FLOP/s, only for the transfer check's compute ratio
DATASHEET_FLOPS = {"a100": 312e12, "h100": 989e12}


def summarise(ratios: Iterable[float]) -> dict[str, Any]:
    """n, RMS of log(predicted/measured), worst ratio, share within +-10% / +-15%."""
    r = [x for x in ratios if x > 0]
    if not r:
        return {"n": 0}
    logs = [math.log(x) for x in r]
    worst = max(r, key=lambda x: abs(math.log(x)))
    return {
        "n": len(r),
        "rms_log": round(math.sqrt(sum(v * v for v in logs) / len(logs)), 4),
        "worst_ratio": round(worst, 3),
        "within_10pct": round(sum(0.9 <= x <= 1.1 for x in r) / len(r), 3),
        "within_15pct": round(sum(0.85 <= x <= 1.15 for x in r) / len(r), 3),
    }


def _cost(model: str, tp: int, device: DeviceProfile) -> CostModel:
    return CostModel(TargetProfile(f"{device.name}-{model}", MODELS[model], tp, device))


def analytic(device: DeviceProfile) -> DeviceProfile:
    """The device's fitted constants alone: no measured operator tables."""
    return replace(device, op_tables={})


def _predicted(cost: CostModel, op: str, num_tokens: int) -> float:
    return cost.layer_linear_s(num_tokens)[op] if op in LINEAR_OPS else cost.elementwise_s(op, num_tokens)


def table_fidelity(device: DeviceProfile, points: list[vidur.OpPoint]) -> dict[str, Any]:
    """The measured-table clock on token counts its table did not hold. `interleaved`: the
    counts of each operator series split alternately in two, each half's table predicting
    the other half (gaps twice the profile's); `calibration_grid`: a table of
    `FULL_GRID`'s token counts only (what `preempt calibrate --device cuda` measures),
    predicting every other count."""
    base = analytic(device)
    layer_ops = set(LINEAR_OPS) | set(ELEMENTWISE_OPS)
    mine = [p for p in points if p.op in layer_ops]
    grid = set(FULL_GRID["tokens"])
    series: dict[tuple[int, str], list[vidur.OpPoint]] = defaultdict(list)
    for p in mine:
        series[(p.tp, p.op)].append(p)
    out: dict[str, Any] = {}
    for name in ("interleaved", "calibration_grid"):
        by_op: dict[str, list[float]] = defaultdict(list)
        layers: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for (tp, op), pts in sorted(series.items()):
            pts = sorted(pts, key=lambda p: p.num_tokens)
            if name == "interleaved":
                folds = [(pts[0::2], pts[1::2]), (pts[1::2], pts[0::2])]
            else:
                folds = [
                    ([p for p in pts if p.num_tokens in grid], [p for p in pts if p.num_tokens not in grid])
                ]
            for table_points, scored in folds:
                if len(table_points) < 2:
                    continue
                cost = _cost(pts[0].model, tp, replace(base, op_tables=op_tables(table_points)))
                for p in scored:
                    predicted = _predicted(cost, op, p.num_tokens)
                    by_op[op].append(predicted / p.measured_s)
                    acc = layers[(tp, p.num_tokens)]
                    acc[0] += predicted
                    acc[1] += p.measured_s
                    acc[2] += 1
        full = [v[0] / v[1] for v in layers.values() if v[2] == len(layer_ops)]
        out[name] = {"layer": summarise(full), "all_points": summarise(x for r in by_op.values() for x in r)}
    return out


def op_fidelity(device: DeviceProfile, points: list[vidur.OpPoint]) -> dict[str, Any]:
    """Per operator and per whole layer, for one (gpu, model) data set."""
    by_op: dict[str, list[float]] = defaultdict(list)
    layers: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    costs: dict[int, CostModel] = {}
    layer_ops = set(LINEAR_OPS) | set(ELEMENTWISE_OPS)
    for p in points:
        predicted = _predicted(costs.setdefault(p.tp, _cost(p.model, p.tp, device)), p.op, p.num_tokens)
        by_op[p.op].append(predicted / p.measured_s)
        if p.op in layer_ops:
            acc = layers[(p.tp, p.num_tokens)]
            acc[0] += predicted
            acc[1] += p.measured_s
            acc[2] += 1
    full = {k: v for k, v in layers.items() if v[2] == len(layer_ops)}
    layer_ratio = {k: v[0] / v[1] for k, v in full.items()}
    return {
        "by_op": {op: summarise(r) for op, r in sorted(by_op.items())},
        "layer": summarise(layer_ratio.values()),
        "layer_decode_like": summarise(r for (_, t), r in layer_ratio.items() if t <= DECODE_MAX_TOKENS),
        "layer_prefill_like": summarise(r for (_, t), r in layer_ratio.items() if t >= PREFILL_MIN_TOKENS),
        "all_points": summarise(x for r in by_op.values() for x in r),
    }


def attention_fidelity(device: DeviceProfile, points: list[vidur.AttnPoint]) -> dict[str, Any]:
    # the attention file's shape (64 q / 8 kv heads, TP 2) and its kernel, which computes
    # the masked pairs inside a chunk (the served kernel the profile states does not)
    cost = _cost("llama3-70b", 2, replace(device, attn_masked_share=PROFILED_MASKED_SHARE))
    decode, prefill = [], []
    for p in points:
        ratio = (
            cost.attention_s(p.sum_attn_ctx, p.sum_kv_read, p.prefill_rows, p.sum_masked_ctx) / p.measured_s
        )
        (prefill if p.is_prefill else decode).append(ratio)
    return {"decode": summarise(decode), "prefill": summarise(prefill)}


def all_reduce_fidelity(device: DeviceProfile, points: list[vidur.AllReducePoint]) -> dict[str, Any]:
    out = {}
    for n in sorted({p.num_gpus for p in points}):
        if n not in device.all_reduce:
            continue
        latency, rate = device.all_reduce[n]
        out[str(n)] = summarise(
            (latency + 2 * p.num_bytes / rate) / p.measured_s for p in points if p.num_gpus == n
        )
    return out


def layer_table(device: DeviceProfile, points: list[vidur.OpPoint], tp: int = 1) -> list[dict[str, Any]]:
    """Whole-layer predicted vs measured at a few token counts (the docs' table)."""
    wanted = (1, 8, 32, 128, 256, 384, 512, 1024, 2048, 4096)
    cost = None
    layer_ops = set(LINEAR_OPS) | set(ELEMENTWISE_OPS)
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for p in points:
        if p.tp != tp or p.num_tokens not in wanted or p.op not in layer_ops:
            continue
        cost = cost or _cost(p.model, tp, device)
        predicted = _predicted(cost, p.op, p.num_tokens)
        sums[p.num_tokens][0] += predicted
        sums[p.num_tokens][1] += p.measured_s
    return [
        {
            "tokens": t,
            "predicted_us": round(v[0] * 1e6, 1),
            "measured_us": round(v[1] * 1e6, 1),
            "ratio": round(v[0] / v[1], 3),
        }
        for t, v in sorted(sums.items())
    ]


# What the clock charges beside the GPU work, and what each source's number includes: the
# mismatch is reported, not corrected (the points are held out).
PUBLISHED_OVERHEADS = {
    "clock": "cpu_step_overhead_s per step (1 ms on every bundled profile, an assumption: vLLM V1's "
    "host time), included in predicted_ms; gpu_ms is the same steps without it",
    "gpt-fast": "torch.compile mode=reduce-overhead (CUDA graphs): host time per step near zero, so "
    "the clock's 1 ms per step is extra; tensor parallel uses PyTorch's intra-node custom all-reduce, "
    "where the clock charges Vidur's NCCL latency (~40 us per all-reduce on A100, 2 per layer); "
    "A100s power-limited to 330 W, hybrid cube mesh (not the DGX the A100 all-reduce was profiled on)",
    "TensorRT-LLM": "C++ runtime (gptSessionBenchmark), static batch; host time per step small; "
    "A100 variant not stated; the first-token rows are the context phase only",
    "vLLM": "LLM.generate wall time of one batch: Python scheduler, sampling and detokenization per "
    "step on top of the GPU (more than the clock's 1 ms at these small steps)",
}


def published_fidelity(
    points: list[published.PublishedPoint] | None = None, analytic_only: bool = False
) -> dict[str, Any]:
    """Predicted / measured seconds for each published point: overall, by source, single-
    vs multi-GPU, with and without the clock's host overhead per step. The clock as it
    runs (a target with measured op tables uses them), or `analytic_only`."""
    points = published.load_published() if points is None else points
    rows = []
    for p in points:
        cost = published.cost_model(p)
        if analytic_only:
            cost = CostModel(replace(cost.target, device=analytic(cost.target.device)))
        pred = published.predict(p, cost)
        rows.append(
            {
                "id": p.id,
                "source": p.source,
                "gpu": p.device,
                "model": p.model,
                "tp": p.tp,
                "batch": p.batch,
                "input_len": p.input_len,
                "output_len": p.output_len,
                "metric": p.metric,
                "published": f"{p.value:g} {p.unit}",
                "steps": pred.num_steps,
                "measured_ms": round(p.measured_s * 1e3, 2),
                "predicted_ms": round(pred.predicted_s * 1e3, 2),
                "gpu_ms": round(pred.gpu_s * 1e3, 2),
                "all_reduce_ms": round(pred.all_reduce_s * 1e3, 2),
                "ratio": round(pred.predicted_s / p.measured_s, 3),
                "ratio_gpu_only": round(pred.gpu_s / p.measured_s, 3),
            }
        )

    def group(keep: Any) -> dict[str, Any]:
        chosen = [r for r in rows if keep(r)]
        return {
            "with_host_overhead": summarise(r["ratio"] for r in chosen),
            "gpu_only": summarise(r["ratio_gpu_only"] for r in chosen),
        }

    engines = {r["source"].split(" ")[0] for r in rows}
    return {
        "data": "preempt/calibrate/data/published_e2e.csv (sources: its README)",
        "held_out": True,
        "clock": "constants only"
        if analytic_only
        else "as run: measured op tables where the target has them",
        "overheads": PUBLISHED_OVERHEADS,
        "all": group(lambda r: True),
        "single_gpu": group(lambda r: r["tp"] == 1),
        "multi_gpu": group(lambda r: r["tp"] > 1),
        "by_source": {e: group(lambda r, e=e: r["source"].split(" ")[0] == e) for e in sorted(engines)},
        "points": rows,
    }


def measured_fidelity(path: Path) -> dict[str, Any]:
    """The bundled profile of the GPU a `preempt calibrate --device cuda` run measured (its
    fitted constants alone) against that run's GEMM and elementwise times: per operator,
    decode-like and prefill-like counts, and the whole layer. What the measurement's own
    fit would give is not scored: its tables reproduce it by construction."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: not a calibration file ({exc})") from None
    data = data.get("measurements", data)  # the profile file keeps its measurement beside it
    if not isinstance(data, dict) or not {"device", "shape", "linear", "elementwise"} <= set(data):
        raise ProfileError(f"{path}: no measurement in it (write one with `preempt calibrate --device cuda`)")
    gpu = next((name for name in ("h200", "h100", "a100") if name in str(data["device"]).lower()), None)
    if gpu is None:
        raise ProfileError(f"{path}: measured on {data['device']!r}, for which no profile is bundled")
    points = measured_op_points(data)
    if not points:
        raise ProfileError(f"{path}: its shape is no bundled model's (a --tiny run?)")
    device = analytic(load_device(gpu))
    return {
        "measured": f"{data['device']}, {points[0].model} ({data.get('timing', 'one call per point')})",
        "profile": f"preempt/profiles/{gpu}.json: {device.sources.get('linear_flops_per_s', '')}",
        **op_fidelity(device, points),
        "layer_table": layer_table(device, points),
    }


def bench_clock(quick: bool = False, measured: str | None = None) -> dict[str, Any]:
    """Fidelity of the bundled device profiles (quick: the same; it takes seconds); with
    `measured`, also against a GPU calibration run (`measured_fidelity`)."""
    if measured is not None:
        return {"measured_gpu": measured_fidelity(Path(measured)), **bench_clock(quick)}
    ops, attention, all_reduce = vidur.load_ops(), vidur.load_attention(), vidur.load_all_reduce()
    devices = {gpu: analytic(load_device(gpu)) for gpu in ("h100", "a100")}
    datasets = []
    for gpu, model in sorted({(p.gpu, p.model) for p in ops}):
        points = [p for p in ops if p.gpu == gpu and p.model == model]
        datasets.append(
            {
                "gpu": gpu,
                "model": model,
                "used_in_fit": model in FIT_SETS[gpu],
                **op_fidelity(devices[gpu], points),
                "measured_table": table_fidelity(devices[gpu], points),
            }
        )
    transfer = derive_device(
        devices["h100"], "a100", "h100", compute_ratio=DATASHEET_FLOPS["a100"] / DATASHEET_FLOPS["h100"]
    )
    return {
        "source": "Vidur profiles (microsoft/vidur, MIT), bundled in preempt/profiles/vidur",
        "decode_like_max_tokens": DECODE_MAX_TOKENS,
        "prefill_like_min_tokens": PREFILL_MIN_TOKENS,
        "datasets": datasets,
        "attention_a100": {"used_in_fit": True, **attention_fidelity(devices["a100"], attention)},
        "all_reduce": {
            gpu: all_reduce_fidelity(devices[gpu], [p for p in all_reduce if p.gpu == gpu]) for gpu in devices
        },
        "layer_table_h100_llama2_7b_tp1": layer_table(
            devices["h100"], [p for p in ops if p.gpu == "h100" and p.model == "llama2-7b"]
        ),
        "layer_table_h100_llama2_70b_tp4": layer_table(
            devices["h100"], [p for p in ops if p.gpu == "h100" and p.model == "llama2-70b"], tp=4
        ),
        "transfer_h100_to_a100": {
            "method": "H100 fit, bandwidths x HBM datasheet ratio, FLOP/s x datasheet bf16 ratio",
            **{
                model: op_fidelity(transfer, [p for p in ops if p.gpu == "a100" and p.model == model])[
                    "layer"
                ]
                for model in ("llama3-8b", "llama3-70b")
            },
            "attention_a100_from_h100": "n/a (H100 attention is itself carried from the A100)",
        },
        "published": published_fidelity(),
        "published_analytic": {
            k: v
            for k, v in published_fidelity(analytic_only=True).items()
            if k not in ("points", "overheads")
        },
    }
