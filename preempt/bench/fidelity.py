"""`preempt bench fidelity`: the simulator against a real vLLM, on the same requests.

1. Requests: windows of a bundled Azure trace with their own arrivals and SLA classes
   (`WorkloadConfig`), lengths scaled by `length_scale` to the served model's speed, the
   arrival rate by `rate_scale`, so that the KV pool runs out and vLLM preempts.
2. The real side: the peer's `vllm serve` (`make peer`) on a random-weight Llama where
   recomputing costs (`preempt.model.random_llama`, preset `fidelity`), one server per
   vLLM policy (FCFS and priority) with vLLM's own scheduler logging every step
   (`preempt.integrations.vllm.steplog.StepLogScheduler`); the requests are sent at their
   arrival times with the openai client (streamed, greedy, EOS ignored: every request
   generates exactly its trace's output length).
3. Calibration on the fit windows only: `preempt.calibrate.vllm_steps` fits a target
   profile to the steps vLLM took during them.
4. The simulated side: preempt's engine with the matching policy (`vllm_fcfs`,
   `vllm_priority`: vLLM 0.32's scheduler, step-identical to it, docs/parity.md) on the
   calibrated clock, replaying each judge window's requests at the times the client sent
   them, with the engine shape the server had.
5. The comparison on the judge windows: TTFT, TPOT and e2e per request (mean, p50, p90,
   p99 over the windows' requests pooled, and the mean relative error over windows with a
   95% interval), steps, preemptions, recomputed tokens and throughput; and where the
   error comes from (`sources`): the calibrated step formula on the judge windows' own
   steps, the time between the client's send and the scheduler's `add_request`, and the
   time between the scheduler's first token and the client's.

This module never imports vLLM; the servers are subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from preempt.bench.vllm_http import HttpRequest, ServeArm, _free_port, drive, serve_command, vllm_server, write_model
from preempt.obs.stats import t_interval

STEP_LOG_CLS = "preempt.integrations.vllm.steplog.StepLogScheduler"
POLICIES = ("fcfs", "priority")
METRICS = ("ttft_s", "tpot_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True)
class FidelitySetup:
    """What both sides run: the trace windows, the scaling, the engine's shape."""

    trace: str = "azure-conv"
    window_s: float = 16.0  # trace seconds per window (before rate scaling)
    # window starts, trace seconds: the profile is fitted on `fit_starts` only
    fit_starts: tuple[float, ...] = (300.0, 1500.0)
    judge_starts: tuple[float, ...] = (600.0, 1200.0, 1800.0, 2400.0)
    rate_scale: float = 0.4
    length_scale: float = 0.25
    seed: int = 0
    preset: str = "fidelity"
    policies: tuple[str, ...] = POLICIES
    engine: dict[str, Any] = field(
        default_factory=lambda: {
            "dtype": "float32",
            "block_size": 32,  # vLLM's CPU attention: multiples of 32
            "num_gpu_blocks": 96,  # its null block included: 95 usable, 3,040 tokens
            "max_model_len": 2048,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 512,
        }
    )


QUICK = FidelitySetup(
    window_s=4.0, fit_starts=(300.0,), judge_starts=(600.0,), rate_scale=0.25, length_scale=0.1,
    preset="served", policies=("fcfs",),
    engine={"dtype": "bfloat16", "block_size": 32, "num_gpu_blocks": 24, "max_model_len": 512,
            "max_num_seqs": 8, "max_num_batched_tokens": 256},
)  # fmt: skip


@dataclass(frozen=True)
class WindowRequest:
    index: int
    arrival_s: float  # in the window, after rate scaling
    prompt: list[int]
    output_tokens: int
    priority: int  # vLLM's: smaller is more important


def window_requests(setup: FidelitySetup, start_s: float) -> list[WindowRequest]:
    """One window's requests: the trace's arrivals, prompts and output lengths (scaled),
    the SLA classes of the workload's default mix as vLLM priorities."""
    from preempt.core.config import WorkloadConfig
    from preempt.core.workload import build_workload

    cfg = WorkloadConfig(
        trace=setup.trace, start_s=start_s, duration_s=setup.window_s, rate_scale=setup.rate_scale
    )
    requests = build_workload(cfg, seed=setup.seed)
    top = max(r.sla_level for r in requests)
    engine = setup.engine
    usable_tokens = (engine["num_gpu_blocks"] - 1) * engine["block_size"]
    limit = min(engine["max_model_len"] - 1, usable_tokens)
    out = []
    for r in requests:
        output = max(1, round(r.target_output_tokens * setup.length_scale))
        output = min(output, limit // 2)
        prompt = max(1, min(round(len(r.prompt_token_ids) * setup.length_scale), limit - output))
        out.append(
            WindowRequest(
                r.request_id, r.arrival_s, [int(t) for t in r.prompt_token_ids[:prompt]], output, top - r.sla_level
            )
        )
    return out


def request_id(window: str, index: int) -> str:
    return f"{window}-{index:05d}"


# ----------------------------------------------------------------------- the real side
def run_real(
    peer_python: Path, work_dir: Path, setup: FidelitySetup, windows: dict[str, list[WindowRequest]]
) -> dict[str, Any]:
    """Per policy: one `vllm serve` with every step logged, warmed up, then each window in
    turn (each drains before the next). Returns per policy its step log's path and per
    window the client's records and the wall-clock time it started."""
    model_dir = write_model(peer_python, work_dir / f"model-{setup.preset}", setup.preset)
    vllm_bin = peer_python.parent / "vllm"
    out: dict[str, Any] = {}
    for policy in setup.policies:
        log = work_dir / f"steps-{policy}.jsonl"
        log.unlink(missing_ok=True)
        arm = ServeArm(f"vllm_{policy}", policy)
        extra = ["--scheduler-cls", STEP_LOG_CLS, "--additional-config", json.dumps({"step_log": str(log)})]
        command = serve_command(vllm_bin, model_dir, _free_port(), arm, setup.engine, extra)
        runs: dict[str, Any] = {}
        with vllm_server(command, work_dir / f"server-{policy}.log") as server:
            warm = [HttpRequest(-1 - i, 0, 0.05 * i, [65 + i] * 64, 8) for i in range(4)]
            asyncio.run(drive(server.url, warm))  # one-time costs, not measured
            for name, requests in windows.items():
                http = [
                    HttpRequest(
                        r.index, r.priority if policy == "priority" else 0, r.arrival_s, r.prompt,
                        r.output_tokens, request_id(name, r.index),
                    )
                    for r in requests
                ]  # fmt: skip
                started = time.time()
                records = asyncio.run(drive(server.url, http))
                runs[name] = {"started": started, "ended": time.time(), "records": records}
        out[policy] = {"step_log": str(log), "command": command, "windows": runs}
    return out


# ------------------------------------------------------------------ the simulated side
def simulate(
    setup: FidelitySetup, policy: str, target: Path, requests: Sequence[WindowRequest], sent: dict[int, float]
) -> dict[str, Any]:
    """preempt's engine (`vllm_<policy>`, null backend, the calibrated clock) on the
    window's requests, each arriving when the client sent it (`sent`: index -> seconds
    after the window started)."""
    from preempt.engine.engine import Engine
    from preempt.parity.ours import engine_config, workload_request
    from preempt.parity.workload import ParityRequest, ParityWorkload

    engine_shape = {k: v for k, v in setup.engine.items() if k != "dtype"}
    workload = ParityWorkload(
        name="fidelity",
        policy=policy,
        requests=[
            ParityRequest(id=r.index, prompt_tokens=len(r.prompt), output_tokens=r.output_tokens, priority=r.priority)
            for r in requests
        ],
        **engine_shape,
    )
    config = engine_config(workload, policy, [f"clock.target={target}"])
    engine = Engine(config)
    done = engine.run([workload_request(spec, sent[spec.id]) for spec in workload.requests])
    records = [
        {
            "id": r.request_id,
            "priority": -r.sla_level,
            "arrival_s": r.arrival_s,
            "ttft_s": r.first_token_s - r.arrival_s,
            "e2e_s": r.finish_s - r.arrival_s,
            "tokens": r.num_output_tokens,
        }
        for r in done
    ]
    recomputed = sum(rec.num_tokens for rec in engine.scheduler.records if rec.action == "recompute")
    stats = engine.stats()
    return {
        "records": records,
        "steps": stats["num_steps"],
        "preemptions": stats["num_preemptions"],
        "recomputed_tokens": recomputed,
        "makespan_s": max(r.finish_s for r in done) - min(r.arrival_s for r in done),
    }


# ----------------------------------------------------------------------- comparing
def _percentiles(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return {s: math.nan for s in STATS}
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def _per_request(records: Sequence[dict]) -> dict[str, list[float]]:
    """TTFT, TPOT ((e2e - TTFT) / (tokens - 1), requests of 2+ tokens) and e2e."""
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for r in records:
        out["ttft_s"].append(r["ttft_s"])
        out["e2e_s"].append(r["e2e_s"])
        if r["tokens"] > 1:
            out["tpot_s"].append((r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1))
    return out


def real_records(run: dict[str, Any]) -> list[dict]:
    return [
        {
            "id": r["id"],
            "priority": r["priority"],
            "arrival_s": r["sent_wall"] - run["started"],
            "ttft_s": r["ttft_s"],
            "e2e_s": r["latency_s"],
            "tokens": len(r["token_ids"]),
        }
        for r in run["records"]
    ]


def engine_side(log, run: dict[str, Any], window: str) -> dict[str, Any]:
    """What vLLM's scheduler saw of one window (from its step log): steps, preemptions,
    recomputed tokens, and per request the client-to-scheduler delay of its arrival and
    the scheduler-to-client delay of its first token."""
    since, until = run["started"], run["ended"]
    steps = [s for s in log.steps if since <= s["t"] < until and s["chunks"]]
    prefix = f"{window}-"

    def index(engine_id: str) -> int | None:
        # vLLM's completions route names a request cmpl-<its id>-<n>[-<suffix>]
        start = engine_id.find(prefix)
        return None if start < 0 else int(engine_id[start + len(prefix) : start + len(prefix) + 5])

    added = {index(a["id"]): a for a in log.adds if index(a["id"]) is not None}
    prompts = {i: a["prompt"] for i, a in added.items()}
    first_token: dict[int, float] = {}
    preemptions = recomputed = 0
    for step in steps:
        for engine_id, (before, new) in zip(step["ids"], step["chunks"], strict=True):
            i = index(engine_id)
            if i is not None and i not in first_token and before + new >= prompts.get(i, math.inf):
                first_token[i] = step["end"]
        for engine_id, tokens in step["preempted"]:
            if index(engine_id) is not None:
                preemptions += 1
                recomputed += tokens
    sent = {r["id"]: r["sent_wall"] for r in run["records"]}
    client_first = {r["id"]: r["sent_wall"] + r["ttft_s"] for r in run["records"]}
    to_scheduler = [added[i]["t"] - sent[i] for i in sent if i in added]
    to_client = [client_first[i] - first_token[i] for i in client_first if i in first_token]
    return {
        "steps": len(steps),
        "preemptions": preemptions,
        "recomputed_tokens": recomputed,
        "arrival_delay_s": _percentiles(to_scheduler),
        "first_token_delay_s": _percentiles(to_client),
    }


def _relative(sim: float, real: float) -> float:
    return sim / real - 1.0 if real else math.nan


def compare(real: Sequence[Sequence[dict]], sim: Sequence[Sequence[dict]]) -> dict[str, Any]:
    """Per metric and statistic: real and simulated over every window's requests pooled,
    the relative error (sim / real - 1), and its mean over windows with a 95% interval."""
    out: dict[str, Any] = {}
    per_real = [_per_request(w) for w in real]
    per_sim = [_per_request(w) for w in sim]
    for metric in METRICS:
        pooled_real = _percentiles([v for w in per_real for v in w[metric]])
        pooled_sim = _percentiles([v for w in per_sim for v in w[metric]])
        row = {}
        for stat in STATS:
            by_window = [
                _relative(_percentiles(s[metric])[stat], _percentiles(r[metric])[stat])
                for r, s in zip(per_real, per_sim, strict=True)
            ]
            row[stat] = {
                "real": round(pooled_real[stat], 4),
                "sim": round(pooled_sim[stat], 4),
                "error": round(_relative(pooled_sim[stat], pooled_real[stat]), 4),
                "error_by_window": t_interval(by_window)._asdict(),
            }
        out[metric] = row
    return out


def _count_error(real: Sequence[float], sim: Sequence[float]) -> dict[str, Any]:
    total_real, total_sim = sum(real), sum(sim)
    return {
        "real": list(real),
        "sim": list(sim),
        "error": round(_relative(total_sim, total_real), 4) if total_real else None,
    }


def bench_fidelity(
    peer_python: Path, work_dir: Path, quick: bool = False, setup: FidelitySetup | None = None
) -> dict[str, Any]:
    """The whole loop (module docstring): real runs, calibration on the fit windows,
    simulated runs of the judge windows, the comparison per policy."""
    from preempt.calibrate.vllm_steps import calibrate_vllm, errors, read_step_log, shape_of, timed_steps
    from preempt.core.cost_model import CostModel
    from preempt.core.profiles import load_target

    setup = setup or (QUICK if quick else FidelitySetup())
    work_dir.mkdir(parents=True, exist_ok=True)
    names = {f"fit{k}": s for k, s in enumerate(setup.fit_starts)}
    names.update({f"judge{k}": s for k, s in enumerate(setup.judge_starts)})
    windows = {name: window_requests(setup, start) for name, start in names.items()}
    started = time.perf_counter()
    real = run_real(peer_python, work_dir, setup, windows)
    real_s = time.perf_counter() - started

    # calibrate: every policy's steps inside the fit windows
    fit_spans = [
        (real[p]["windows"][n]["started"], real[p]["windows"][n]["ended"])
        for p in setup.policies
        for n in names
        if n.startswith("fit")
    ]
    logs = [real[p]["step_log"] for p in setup.policies]
    profile = calibrate_vllm(logs, name=f"vllm-cpu-{setup.preset}", windows=fit_spans)
    target = work_dir / "target.json"
    target.write_text(json.dumps(profile, indent=1) + "\n")
    cost = CostModel(load_target(target))

    judged = [n for n in names if n.startswith("judge")]
    policies: dict[str, Any] = {}
    for policy in setup.policies:
        log = read_step_log(real[policy]["step_log"])
        runs = real[policy]["windows"]
        real_w, sim_w, engine_w, sim_runs = [], [], [], []
        for name in judged:
            records = real_records(runs[name])
            sent = {r["id"]: r["arrival_s"] for r in records}
            sim = simulate(setup, policy, target, windows[name], sent)
            real_w.append(records)
            sim_w.append(sim["records"])
            sim_runs.append(sim)
            engine_w.append(engine_side(log, runs[name], name))
        judge_steps = [
            (shape_of(step), s)
            for name in judged
            for step, s in timed_steps(log, runs[name]["started"], runs[name]["ended"])
        ]
        tokens_real = [sum(r["tokens"] for r in w) for w in real_w]
        span_real = [max(r["arrival_s"] + r["e2e_s"] for r in w) - min(r["arrival_s"] for r in w) for w in real_w]
        policies[policy] = {
            "latency": compare(real_w, sim_w),
            "steps": _count_error([e["steps"] for e in engine_w], [s["steps"] for s in sim_runs]),
            "preemptions": _count_error([e["preemptions"] for e in engine_w], [s["preemptions"] for s in sim_runs]),
            "recomputed_tokens": _count_error(
                [e["recomputed_tokens"] for e in engine_w], [s["recomputed_tokens"] for s in sim_runs]
            ),
            "throughput_tok_s": _count_error(
                [round(t / s, 2) for t, s in zip(tokens_real, span_real, strict=True)],
                [round(t / s["makespan_s"], 2) for t, s in zip(tokens_real, sim_runs, strict=True)],
            ),
            "sources": {
                "step_formula_on_judge_steps": errors(cost, judge_steps),
                "arrival_delay_s": [e["arrival_delay_s"] for e in engine_w],
                "first_token_delay_s": [e["first_token_delay_s"] for e in engine_w],
            },
            "requests": [len(w) for w in real_w],
        }
    return {
        "setup": asdict(setup),
        "windows": {n: len(w) for n, w in windows.items()},
        "profile": {"path": str(target), "fit": profile["fit"]},
        "policies": policies,
        "real_s": round(real_s, 1),
        "commands": {p: real[p]["command"] for p in setup.policies},
    }
