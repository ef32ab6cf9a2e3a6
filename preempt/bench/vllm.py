"""`preempt bench vllm`: preempt's policy inside real vLLM, beside vLLM's own schedulers
and preempt's own engine.

Two parts, both through the peer virtualenv (`make peer`; `preempt.integrations.vllm.peer`
runs there, this module never imports vLLM):

- `llm`: one priority-mixed workload (seeded, built here) through a real `vllm.LLM` on a
  tiny random-weight Llama written locally: (a) vLLM's default fcfs scheduler, (a') vLLM's
  priority scheduler, (b) vLLM with the plugin (`steps` clock, so decisions do not depend
  on this machine's speed). Per arm: TTFT in engine steps per SLA class, preemptions
  (counted at vLLM's `_preempt_request`, and vLLM's own `vllm:num_preemptions` beside the
  plugin's `preempt:preemptions` from the same Prometheus registry), recomputed tokens,
  and whether every request's greedy tokens equal the fcfs arm's.
- `decisions`: bundled parity workloads through (b) the plugin, driven without a model as
  `preempt parity vllm` drives vLLM, and (c) preempt's own engine with the same policy;
  the plugin replays the engine's clock, so every step's decisions are compared.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from preempt.integrations.vllm.ours import plugin_engine_config, run_ours_timed
from preempt.integrations.vllm.settings import parse_settings
from preempt.parity.compare import compare_traces
from preempt.parity.harness import peer_python, run_vllm
from preempt.parity.workload import load_workload

PEER_MODULE = "preempt.integrations.vllm.peer"
DECISION_WORKLOADS = ("priority-mix", "burst-tight", "staggered", "long-prompts-chunked")
TOP_PRIORITY = 0  # vLLM's priority: smaller is more important; preempt reads sla = -priority
LOW_PRIORITY = 3
PLUGIN_SETTINGS = {"policy": "priority_score", "clock": "steps", "step_ms": 10.0}

# The plugin's decisions are checked under its own defaults and under preempt's engine
# defaults (every preemption fills the rate cap, the design's unbounded 1.2/s age term):
# the second is what exercises the cap on the bundled workloads.
DECISION_SETTINGS = {
    "plugin_defaults": {},
    "engine_defaults": {
        "preemption": {
            "rate_cap_counts": "all",
            "priority_weights": {"age": 1.2, "age_cap_s": None},
            "backoff": {"counts": "all"},
        }
    },
}


def llm_workload(seed: int = 0, quick: bool = False) -> dict:
    """Low-priority requests fill the KV pool first; top-priority ones arrive while it is
    full. Block size 32 (vLLM's CPU attention needs multiples of 32)."""
    rng = random.Random(seed)
    # quick: 8 then 4 (top ones from step 15, every 10); full: the shape of the HTTP run
    # in docs/vllm_plugin.md, 60 then 20 (top ones after the 60th, every 5 steps)
    num_low, num_high, first_high, every = (8, 4, 15, 10) if quick else (60, 20, 60, 5)
    requests = []
    for i in range(num_low):
        requests.append(
            {"id": i, "priority": LOW_PRIORITY, "arrival_step": i, "max_tokens": 48,
             "prompt_token_ids": [rng.randrange(3, 500) for _ in range(96)]}
        )  # fmt: skip
    for j in range(num_high):
        requests.append(
            {"id": 100 + j, "priority": TOP_PRIORITY, "arrival_step": first_high + every * j,
             "max_tokens": 16, "prompt_token_ids": [rng.randrange(3, 500) for _ in range(64)]}
        )  # fmt: skip
    engine = {"block_size": 32, "num_gpu_blocks": 24, "max_model_len": 512, "max_num_seqs": 8,
              "max_num_batched_tokens": 256, "dtype": "bfloat16"}  # fmt: skip
    return {"engine": engine, "requests": requests}


def llm_job(model_dir: str | Path, seed: int = 0, quick: bool = False) -> dict:
    # The full run's steps last 25 ms on the plugin's clock, the pace of `vllm serve` on
    # this machine (~400 generated tokens/s over up to 8 requests, `bench vllm --http`):
    # ages then grow as they do on a server's wall clock.
    settings = PLUGIN_SETTINGS if quick else {**PLUGIN_SETTINGS, "step_ms": 25.0}
    arms = [
        {"name": "vllm_fcfs", "scheduler": "default", "policy": "fcfs"},
        {"name": "vllm_priority", "scheduler": "default", "policy": "priority"},
        {"name": "plugin", "scheduler": "preempt", "policy": "priority", "settings": settings},
        # the plugin's defaults before they were the plugin's own: every preemption fills
        # the rate cap, and the design's unbounded 1.2/s age term
        {"name": "plugin_engine_defaults", "scheduler": "preempt", "policy": "priority",
         "settings": {**settings, **DECISION_SETTINGS["engine_defaults"]}},
    ]  # fmt: skip
    return {"kind": "llm", "model_dir": str(model_dir), "arms": arms, **llm_workload(seed, quick)}


def mean_by_priority(requests: Sequence[dict], value: Callable[[dict], float]) -> dict[str, float]:
    """`value` of the requests averaged per vLLM priority: {"priority_<p>": mean}."""
    by: dict[int, list[float]] = {}
    for r in requests:
        by.setdefault(r["priority"], []).append(value(r))
    return {f"priority_{p}": statistics.fmean(v) for p, v in sorted(by.items())}


def ttft_by_class(arm: dict) -> dict[str, float]:
    """Mean TTFT in engine steps (first-token step - arrival step) per vLLM priority."""
    return mean_by_priority(arm["requests"], lambda r: r["first_token_step"] - r["arrival_step"])


def summarize_llm(result: dict) -> dict[str, Any]:
    arms = {arm["name"]: arm for arm in result["arms"]}
    reference = {r["id"]: r["token_ids"] for r in arms["vllm_fcfs"]["requests"]}
    summary = {}
    for name, arm in arms.items():
        same = sum(reference[r["id"]] == r["token_ids"] for r in arm["requests"])
        summary[name] = {
            "ttft_steps": ttft_by_class(arm),
            "steps": arm["steps"],
            "preemptions": arm["preemptions"],
            "recomputed_tokens": arm["recomputed_tokens"],
            "prometheus": arm["prometheus"],
            "plugin": arm["plugin"],
            "outputs_equal_fcfs": f"{same}/{len(arm['requests'])}",
            "engine_start_s": round(arm["start_s"], 1),
            "run_s": round(arm["run_s"], 1),
        }
    return summary


def decision_jobs(
    names: Sequence[str], variants: Sequence[str] = tuple(DECISION_SETTINGS), async_scheduler: bool = False
) -> tuple[list[dict], list]:
    """Per workload and settings variant: the plugin's job and preempt's engine run, both
    with the same effective `preemption` section (the plugin's, laid over its defaults).
    `async_scheduler`: the plugin's class on vLLM's `AsyncScheduler` (driven step by step,
    it must decide as the plain one does)."""
    jobs, ours = [], []
    for variant in variants:
        extra = DECISION_SETTINGS[variant]
        preemption = parse_settings(extra).preemption.model_dump(mode="json", exclude={"mode"})
        settings = {"policy": PLUGIN_SETTINGS["policy"], "preemption": preemption}
        for name in names:
            workload = load_workload(name)
            timed = run_ours_timed(workload, plugin_engine_config(workload, settings["policy"], preemption))
            ours.append((workload, variant, timed))
            jobs.append(
                {"kind": "decisions", "workload": workload.model_dump(), "settings": settings,
                 "clock": {"starts_s": timed.starts_s, "durations_s": timed.durations_s},
                 "async_scheduler": async_scheduler}
            )  # fmt: skip
    return jobs, ours


def summarize_decisions(results: list[dict], ours: list) -> list[dict]:
    rows = []
    for (workload, variant, timed), result in zip(ours, results, strict=True):
        if "error" in result:
            rows.append({"workload": workload.name, "settings": variant, "error": result["error"]})
            continue
        report = compare_traces(result["trace"], timed.trace)
        rows.append(
            {
                "workload": workload.name,
                "settings": variant,
                "identical": report["identical"],
                "first_divergence": report["first_divergence"],
                "totals": report["totals"],
                "plugin_metrics": result["metrics"],
            }
        )
    return rows


def bench_vllm(quick: bool = False, python: str | Path | None = None) -> dict[str, Any]:
    peer = peer_python(python)
    names = DECISION_WORKLOADS[:2] if quick else DECISION_WORKLOADS
    jobs, ours = decision_jobs(names)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="preempt-bench-vllm-") as tmp:
        report = run_vllm([*jobs, llm_job(Path(tmp) / "tiny-llama", quick=quick)], peer, module=PEER_MODULE)
    *decision_results, llm_result = report["results"]
    return {
        "vllm_version": report["vllm_version"],
        "wall_s": round(time.perf_counter() - started, 1),
        "llm": llm_result if "error" in llm_result else summarize_llm(llm_result),
        "decisions": summarize_decisions(decision_results, ours),
    }
