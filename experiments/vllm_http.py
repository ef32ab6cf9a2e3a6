"""`preempt bench vllm --http`: the peer's own `vllm serve` per arm, driven over HTTP on
the same workloads, with top-class TTFT judged by 95% intervals over seeds.

Owns: the summary (intervals, paired differences, the top class's TTFT as a ratio to
vLLM priority's, which arm is best for the top class), per workload shape.
The servers, the workload and the client are preempt.bench.vllm_http's; the intervals
experiments.stats'. Here, not in preempt/bench: only the CLI and experiments/ may import
experiments.stats (tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.stats import t_interval
from preempt.bench.vllm_http import (
    ARMS,
    ENGINE,
    LOW_PRIORITY,
    SHAPES,
    TOP_PRIORITY,
    ServeArm,
    http_workload,
    run_arms,
    write_model,
)


def bench_vllm_http(
    peer_python: Path,
    work_dir: Path,
    quick: bool = False,
    arms: Sequence[ServeArm] = ARMS,
    shapes: Sequence[str] = ("mixed",),
) -> dict[str, Any]:
    """Every arm on the same workloads of each shape (`SHAPES`; 5 seeds each; `quick`: 2
    seeds of a smaller one), one server per arm for all of them. Per shape: the workload,
    the summary (`summarize_http`)."""
    num_seeds, sizes = (2, (16, 6)) if quick else (5, (60, 20))
    workloads = [
        http_workload(*sizes, seed=seed, shape=shape) for shape in shapes for seed in range(num_seeds)
    ]
    model_dir = write_model(peer_python, work_dir / "tiny-byte-llama")
    results = run_arms(peer_python.parent / "vllm", model_dir, arms, workloads, work_dir)
    out: dict[str, Any] = {}
    for k, shape in enumerate(shapes):
        form = SHAPES[shape]
        part = [{**r, "runs": r["runs"][k * num_seeds : (k + 1) * num_seeds]} for r in results]
        out[shape] = {
            "workload": {
                "seeds": num_seeds,
                "priority_3": sizes[0],
                "priority_0": sizes[1],
                "priority_3_max_tokens": form.low_max_tokens,
                "priority_0_from_s": form.high_start_s,
                "priority_0_every_s": form.high_every_s,
                "engine": ENGINE,
            },
            **summarize_http(part),
        }
    return {"shapes": out, "start_s": results[0]["start_s"]}


def summarize_http(results: Sequence[dict]) -> dict[str, Any]:
    """`run_arms` results -> per arm: top-class (and low-class) TTFT as a mean over seeds
    with a 95% t-interval, its difference from `vllm_priority` paired by seed and its
    ratio to it (mean over mean, and seed by seed), greedy outputs equal to the first
    arm's; the arm best for the top class by mean, and the plugin's ratio on its own."""
    top, low = f"priority_{TOP_PRIORITY}", f"priority_{LOW_PRIORITY}"
    reference = results[0]
    bar = next((r for r in results if r["name"] == "vllm_priority"), None)
    summary = {}
    # the bar first, so that every other arm's row can divide by it
    for result in sorted(results, key=lambda r: r is not bar):
        runs = result["runs"]

        def over_seeds(value, runs=runs) -> dict:
            return t_interval([value(run) for run in runs])._asdict()

        pairs = [(a, b) for run, ref in zip(runs, reference["runs"], strict=True)
                 for a, b in zip(run["requests"], ref["requests"], strict=True)]  # fmt: skip
        same = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
        row = {
            "ttft_top_s": over_seeds(lambda run: run["ttft_s"][top]),
            "ttft_top_s_per_seed": [round(run["ttft_s"][top], 3) for run in runs],
            "ttft_low_s": over_seeds(lambda run: run["ttft_s"][low]),
            "wall_s": over_seeds(lambda run: run["wall_s"]),
            "preemptions": result["metrics"].get("vllm:num_preemptions_total"),
            "plugin_metrics": {k: v for k, v in result["metrics"].items() if k.startswith("preempt:")},
            f"outputs_equal_{reference['name']}": f"{same}/{len(pairs)}",
            "exit_code": result["exit_code"],
        }
        if bar is not None and result is not bar:
            diffs = [run["ttft_s"][top] - b["ttft_s"][top] for run, b in zip(runs, bar["runs"], strict=True)]
            row["ttft_top_minus_vllm_priority_s"] = t_interval(diffs)._asdict()
            row["ttft_top_over_vllm_priority"] = _ratio(
                row["ttft_top_s"]["mean"], summary["vllm_priority"]["ttft_top_s"]["mean"]
            )
            row["ttft_top_over_vllm_priority_per_seed"] = [
                _ratio(run["ttft_s"][top], b["ttft_s"][top]) for run, b in zip(runs, bar["runs"], strict=True)
            ]
        summary[result["name"]] = row
    summary = {r["name"]: summary[r["name"]] for r in results}  # the arms' own order
    best = min(summary, key=lambda name: summary[name]["ttft_top_s"]["mean"])
    out = {"arms": summary, "best_for_top_class": best}
    if "plugin" in summary and "ttft_top_over_vllm_priority" in summary["plugin"]:
        out["plugin_over_vllm_priority"] = summary["plugin"]["ttft_top_over_vllm_priority"]
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None
