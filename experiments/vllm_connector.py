"""`preempt bench vllm --http --connector`: preempt's KV connector against vLLM's recompute,
per regime, with 95% intervals over seeds.

Owns: the summary (per arm and regime: means with t-intervals, differences from plain
vLLM paired by seed, greedy outputs against plain vLLM's). The servers, the workloads and
the counters are preempt.bench.vllm_connector's; the intervals experiments.stats'.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.stats import t_interval
from preempt.bench.vllm_connector import (
    CONNECTOR_ARMS,
    REGIMES,
    ConnectorArm,
    forced_preemptions,
    run_connector_arms,
)
from preempt.bench.vllm_http import ENGINE, write_model

BASELINE = "vllm"
QUANTITIES = ("recomputed_tokens", "latency_s", "ttft_s", "max_gap_s", "output_tokens_per_s", "wall_s")


def bench_vllm_connector(
    peer_python: Path, work_dir: Path, quick: bool = False, arms: Sequence[ConnectorArm] = CONNECTOR_ARMS
) -> dict[str, Any]:
    """Every arm on the same workloads: 3 seeds of 16 requests per regime (`quick`: 2 of 8)."""
    num_seeds, num = (2, 8) if quick else (3, 16)
    workloads = {
        regime: [forced_preemptions(regime, num=num, seed=seed) for seed in range(num_seeds)]
        for regime in REGIMES
    }
    model_dir = write_model(peer_python, work_dir / "tiny-byte-llama")
    # float32: outputs are compared token for token, and in bf16 a random model's top
    # logits tie to the last bit, which the batch's shape sets
    engine = {**ENGINE, "dtype": "float32"}
    results = run_connector_arms(peer_python.parent / "vllm", model_dir, arms, workloads, work_dir, engine)
    return {
        "workload": {"seeds": num_seeds, "requests": num, "prompt_tokens": REGIMES, "engine": engine},
        "regimes": {regime: summarize_connector(results, regime) for regime in REGIMES},
        "commands": {result["name"]: result["command"] for result in results},
    }


def summarize_connector(results: Sequence[dict], regime: str) -> dict[str, Any]:
    """Per arm: each quantity's mean over seeds with its 95% t-interval and its difference
    from plain vLLM's paired by seed; the connector's counters summed over seeds; greedy
    outputs equal to plain vLLM's (request by request)."""
    base = next(r for r in results if r["name"] == BASELINE)["runs"][regime]
    summary = {}
    for result in results:
        runs = result["runs"][regime]
        row: dict[str, Any] = {}
        for quantity in QUANTITIES:
            row[quantity] = t_interval([run[quantity] for run in runs])._asdict()
            if result["name"] != BASELINE:
                diffs = [run[quantity] - b[quantity] for run, b in zip(runs, base, strict=True)]
                row[f"{quantity}_minus_{BASELINE}"] = t_interval(diffs)._asdict()
        counters: dict[str, float] = {}
        for run in runs:
            for key, value in run["counters"].items():
                if not key.endswith(("_bucket", "_created")):
                    counters[key] = counters.get(key, 0.0) + value
        row["counters"] = counters
        pairs = [(a["token_ids"], b["token_ids"]) for run, ref in zip(runs, base, strict=True)
                 for a, b in zip(run["requests"], ref["requests"], strict=True)]  # fmt: skip
        row[f"outputs_equal_{BASELINE}"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        row["exit_code"] = result["exit_code"]
        summary[result["name"]] = row
    return summary


def connector_table(summary: dict[str, Any]) -> str:
    """The bench's result as a markdown table per regime (means with 95% intervals)."""

    def cell(interval: dict, digits: int) -> str:
        return f"{interval['mean']:.{digits}f} [{interval['lo']:.{digits}f}, {interval['hi']:.{digits}f}]"

    lines = []
    for regime, arms in summary["regimes"].items():
        tokens = summary["workload"]["prompt_tokens"][regime]
        lines += [
            f"**{regime}** prompts ({tokens} tokens), {summary['workload']['requests']} requests x "
            f"{summary['workload']['seeds']} seeds",
            "",
            "| arm | preemptions | loads | tokens recomputed | latency s | TTFT s | longest stream gap s "
            "| output tok/s | outputs = vllm |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in arms.items():
            counters = row["counters"]
            lines.append(
                f"| {name} | {counters.get('vllm:num_preemptions_total', 0):.0f} "
                f"| {counters.get('preempt:kv_loads_total', 0):.0f} | {cell(row['recomputed_tokens'], 0)} "
                f"| {cell(row['latency_s'], 2)} | {cell(row['ttft_s'], 2)} | {cell(row['max_gap_s'], 2)} "
                f"| {cell(row['output_tokens_per_s'], 0)} "
                f"| {row[f'outputs_equal_{BASELINE}']} |"
            )
        lines.append("")
    return "\n".join(lines)
