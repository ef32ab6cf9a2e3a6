"""`preempt bench vllm --http`: the peer's own `vllm serve` per arm, driven over HTTP on
the same workloads, with top-class TTFT judged by 95% intervals over seeds.

Owns: the summary (intervals, paired differences, which arm is best for the top class).
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
    TOP_PRIORITY,
    ServeArm,
    http_workload,
    run_arms,
    write_model,
)


def bench_vllm_http(
    peer_python: Path, work_dir: Path, quick: bool = False, arms: Sequence[ServeArm] = ARMS
) -> dict[str, Any]:
    """Every arm on the same workloads (5 seeds; `quick`: 2 seeds of a smaller one)."""
    num_seeds, sizes = (2, (16, 6)) if quick else (5, (60, 20))
    workloads = [http_workload(*sizes, seed=seed) for seed in range(num_seeds)]
    model_dir = write_model(peer_python, work_dir / "tiny-byte-llama")
    results = run_arms(peer_python.parent / "vllm", model_dir, arms, workloads, work_dir)
    return {
        "workload": {"seeds": num_seeds, "priority_3": sizes[0], "priority_0": sizes[1], "engine": ENGINE},
        **summarize_http(results),
        "start_s": results[0]["start_s"],
    }


def summarize_http(results: Sequence[dict]) -> dict[str, Any]:
    """`run_arms` results -> per arm: top-class (and low-class) TTFT as a mean over seeds
    with a 95% t-interval, its difference from `vllm_priority` paired by seed, greedy
    outputs equal to the first arm's; and the arm best for the top class by mean."""
    top, low = f"priority_{TOP_PRIORITY}", f"priority_{LOW_PRIORITY}"
    reference = results[0]
    bar = next((r for r in results if r["name"] == "vllm_priority"), None)
    summary = {}
    for result in results:
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
        summary[result["name"]] = row
    best = min(summary, key=lambda name: summary[name]["ttft_top_s"]["mean"])
    return {"arms": summary, "best_for_top_class": best}
