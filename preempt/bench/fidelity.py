"""`preempt bench fidelity`: the simulator against a real vLLM, on the same requests.

1. Requests: windows of a bundled Azure trace with their own arrivals and SLA classes
   (`WorkloadConfig`), lengths scaled by `length_scale` to the served model's speed, the
   arrival rate by `rate_scale`, so that the KV pool runs out and vLLM preempts.
2. The real side: the peer's `vllm serve` (`make peer`) on a random-weight Llama where
   recomputing costs (`preempt.model.random_llama`, preset `fidelity`), one server per
   vLLM policy (FCFS and priority) with vLLM's own scheduler logging every step
   (`preempt.integrations.vllm.steplog.StepLogScheduler`), all up at once and each window
   sent to one after the other (`serve_interleaved`); the requests are sent at their
   arrival times with the openai client (streamed, greedy, EOS ignored: every request
   generates exactly its trace's output length).
3. Calibration on the fit windows only: `preempt.calibrate.vllm_steps` fits a target
   profile to the steps vLLM took during them.
4. The simulated side: preempt's engine with the matching policy (`vllm_fcfs`,
   `vllm_priority`: vLLM 0.32's scheduler, step-identical to it, docs/parity.md) on the
   calibrated clock, replaying each judge window's requests at vLLM's own arrival stamps,
   with the engine shape the server had.
5. The comparison on the judge windows: TTFT, TPOT and e2e per request as vLLM counts them
   (from its arrival stamp to the end of the step that made the token; mean, p50, p90,
   p99 over the windows' requests pooled, and the mean relative error over windows with a
   95% interval), steps, preemptions, recomputed tokens and throughput; the client's view
   over HTTP beside it (the simulator then adds the API server's mean delays, measured on
   the fit windows); and where the error comes from (`sources`): the calibrated step
   formula on the judge windows' own steps, window by window, and the API server's delays.
6. With `connector`, the seed's trade (`judge_trade`): the judge windows also through
   vLLM FCFS with preempt's KV connector, one server per codec, interleaved with the rest.

This module never imports vLLM; the servers are subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from preempt.bench.vllm_http import (
    SERVER_ENV,
    HttpRequest,
    ServeArm,
    _free_port,
    drive,
    pinned_client,
    serve_command,
    vllm_server,
    write_model,
)
from preempt.calibrate.vllm_steps import host_copy_rate
from preempt.obs.stats import t_interval

STEP_LOG_CLS = "preempt.integrations.vllm.steplog.StepLogScheduler"


COPY_SOURCE = "measured: a 64 MiB host memory copy on this machine (best of 5), with the runs"
POLICIES = ("fcfs", "priority")
METRICS = ("ttft_s", "tpot_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True)
class FidelitySetup:
    """What both sides run: the trace windows, the scaling, the engine's shape."""

    trace: str = "azure-conv"
    window_s: float = 16.0  # trace seconds per window (before rate scaling)
    # window starts, trace seconds: the profile is fitted on `fit_starts` only; the windows
    # run in the trace's order, fit and judge interleaved, so that a machine whose speed
    # drifts over the run (a shared host) drifts under both alike
    fit_starts: tuple[float, ...] = (300.0, 1500.0)
    judge_starts: tuple[float, ...] = (600.0, 1200.0, 1800.0, 2400.0, 3000.0)
    rate_scale: float = 0.4
    length_scale: float = 0.25
    seed: int = 0
    preset: str = "fidelity"
    policies: tuple[str, ...] = POLICIES
    engine: dict[str, Any] = field(
        default_factory=lambda: {
            "dtype": "float32",
            "block_size": 32,  # vLLM's CPU attention: multiples of 32
            "num_gpu_blocks": 48,  # its null block included: 47 usable, 1,504 tokens
            "max_model_len": 1504,  # vLLM: at most the usable blocks
            "max_num_seqs": 16,
            "max_num_batched_tokens": 512,
        }
    )


QUICK = FidelitySetup(
    window_s=4.0, fit_starts=(300.0,), judge_starts=(600.0,), rate_scale=0.5, length_scale=0.2,
    preset="served", policies=("fcfs",),
    # 11 usable blocks of 32 tokens: two requests fill the pool, so vLLM preempts
    engine={"dtype": "bfloat16", "block_size": 32, "num_gpu_blocks": 12, "max_model_len": 352,
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
                r.request_id,
                r.arrival_s,
                [int(t) for t in r.prompt_token_ids[:prompt]],
                output,
                top - r.sla_level,
            )
        )
    return out


def request_id(window: str, index: int) -> str:
    return f"{window}-{index:05d}"


def window_index(engine_id: str, window: str) -> int | None:
    """The index of `request_id(window, index)` inside vLLM's own id for it (its
    completions route names a request cmpl-<its id>-<n>[-<suffix>]); None: another
    window's, or the warm-up's."""
    prefix = f"{window}-"
    at = engine_id.find(prefix)
    return None if at < 0 else int(engine_id[at + len(prefix) : at + len(prefix) + 5])


# ----------------------------------------------------------------------- the real side
@dataclass(frozen=True)
class RealArm:
    """One `vllm serve` of the real side."""

    name: str  # its files: steps-<name>.jsonl, server-<name>.log
    policy: str  # vLLM's --scheduling-policy
    extra: tuple[str, ...] = ()  # more `vllm serve` arguments (the KV connector's)
    judge_only: bool = False  # the trade's arms: the judge windows only


def real_arms(setup: FidelitySetup, connector: bool) -> list[RealArm]:
    """One server per vLLM policy; with `connector`, one per codec of the trade (vLLM FCFS
    with preempt's KV connector)."""
    from preempt.integrations.vllm.kv_store import kv_transfer_config

    arms = [RealArm(policy, policy) for policy in setup.policies]
    if connector:
        for codec, (connector_codec, _) in TRADE.items():
            config = json.dumps(kv_transfer_config({"codec": connector_codec}))
            arms.append(RealArm(f"fcfs_{codec}", "fcfs", ("--kv-transfer-config", config), judge_only=True))
    return arms


def serve_interleaved(
    peer_python: Path,
    work_dir: Path,
    setup: FidelitySetup,
    arms: Sequence[RealArm],
    windows: dict[str, list[WindowRequest]],
) -> dict[str, dict[str, Any]]:
    """Every arm's `vllm serve` up at once (vLLM's own scheduler logging every step,
    warmed up), then the windows in the trace's order, each through every arm that takes
    it, one arm at a time (each drains before the next), the arms' order reversed every
    other window. So the arms meet the machine's drift alike, window by window, instead of
    minutes apart (the first runs served arm after arm: the connector's servers ran up to
    13% faster or 12% slower per step than plain vLLM's, docs/fidelity.md). Returns per arm
    the step log's path, the command, the `/metrics` scrape at the end and per window the
    client's records and when it started and ended (wall clock)."""
    from preempt.bench.vllm_http import scrape

    model_dir = write_model(peer_python, work_dir / f"model-{setup.preset}", setup.preset)
    out: dict[str, dict[str, Any]] = {}
    with pinned_client() as cpus:  # the model on its own core (vllm_http.SERVER_ENV), the rest and us not
        with contextlib.ExitStack() as stack:
            servers = {}
            for arm in arms:
                log = work_dir / f"steps-{arm.name}.jsonl"
                log.unlink(missing_ok=True)
                args = [
                    "--scheduler-cls",
                    STEP_LOG_CLS,
                    "--additional-config",
                    json.dumps({"step_log": str(log)}),
                ]
                serve = ServeArm(f"vllm_{arm.name}", arm.policy)
                command = serve_command(
                    peer_python.parent / "vllm",
                    model_dir,
                    _free_port(),
                    serve,
                    setup.engine,
                    [*args, *arm.extra],
                )
                servers[arm.name] = stack.enter_context(
                    vllm_server(command, work_dir / f"server-{arm.name}.log", env=SERVER_ENV, cpus=cpus)
                )
                warm = [HttpRequest(-1 - i, 0, 0.05 * i, [65 + i] * 64, 8) for i in range(4)]
                asyncio.run(drive(servers[arm.name].url, warm))  # one-time costs, not measured
                out[arm.name] = {"step_log": str(log), "command": command, "windows": {}}
            for turn, (window, requests) in enumerate(windows.items()):
                taking = [arm for arm in arms if window.startswith("judge") or not arm.judge_only]
                for arm in reversed(taking) if turn % 2 else taking:
                    http = [
                        HttpRequest(
                            r.index, r.priority if arm.policy == "priority" else 0, r.arrival_s, r.prompt,
                            r.output_tokens, request_id(window, r.index),
                        )
                        for r in requests
                    ]  # fmt: skip
                    started = time.time()
                    records = asyncio.run(drive(servers[arm.name].url, http))
                    out[arm.name]["windows"][window] = {
                        "started": started,
                        "ended": time.time(),
                        "records": records,
                    }
            for arm in arms:
                out[arm.name]["metrics"] = scrape(servers[arm.name].url)
    return out


# ------------------------------------------------------------------ the simulated side
def simulate(
    setup: FidelitySetup,
    policy: str,
    target: Path,
    requests: Sequence[WindowRequest],
    sent: dict[int, float],
    frontend: tuple[float, float] = (0.0, 0.0),
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """preempt's engine (`vllm_<policy>`, null backend, the calibrated clock) on the
    window's requests, each sent by the client at `sent[index]` (seconds after the window
    started). `frontend`: the API server's delays (seconds) from the client's send to the
    scheduler, and from the scheduler's token to the client; a request reaches the engine
    the first later, and the client sees its tokens the second later."""
    from preempt.engine.engine import Engine
    from preempt.parity.ours import engine_config, workload_request
    from preempt.parity.workload import ParityRequest, ParityWorkload

    engine_shape = {k: v for k, v in setup.engine.items() if k != "dtype"}
    workload = ParityWorkload(
        name="fidelity",
        policy=policy,
        requests=[
            ParityRequest(
                id=r.index, prompt_tokens=len(r.prompt), output_tokens=r.output_tokens, priority=r.priority
            )
            for r in requests
        ],
        **engine_shape,
    )
    config = engine_config(workload, policy, [f"clock.target={target}", *overrides])
    engine = Engine(config)
    to_engine, to_client = frontend
    done = engine.run([workload_request(spec, sent[spec.id] + to_engine) for spec in workload.requests])
    records = [
        {
            "id": r.request_id,
            "priority": -r.sla_level,
            "arrival_s": sent[r.request_id],
            "ttft_s": r.first_token_s + to_client - sent[r.request_id],
            "e2e_s": r.finish_s + to_client - sent[r.request_id],
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


# ------------------------------------------------------------- the seed's trade
# The connector's codecs and the engine's swap modes that model them (the connector's
# `mixed`: a random plan, half the (layer, KV head) pairs FP8, none dropped).
TRADE = {
    "raw": ("raw", ["preemption.mode=swap"]),
    "mixed": ("mixed", ["preemption.mode=swap_mixed", "preemption.codecs.mixed.drop_share=0.0"]),
}


def _preempted(log, run: dict[str, Any], window: str) -> set[int]:
    """The window's requests vLLM preempted at least once (from its step log)."""
    out = set()
    for step in log.steps:
        if run["started"] <= step["t"] < run["ended"]:
            for engine_id, _ in step["preempted"]:
                index = window_index(engine_id, window)
                if index is not None:
                    out.add(index)
    return out


def _mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 4) if len(values) else None


def _paired(ours: Sequence[dict], base: Sequence[dict], ids: set[int], key: str) -> list[float]:
    a = {r["id"]: r[key] for r in ours}
    b = {r["id"]: r[key] for r in base}
    return [a[i] - b[i] for i in sorted(ids) if i in a and i in b]


def _decode_steps(log, runs: Sequence[dict[str, Any]]) -> dict[int, list[float]]:
    """The seconds of the plain decode steps (every request one token, nobody preempted)
    within `runs`' spans, by batch size."""
    out: dict[int, list[float]] = {}
    for step in log.steps:
        chunks = step["chunks"]
        if (
            chunks
            and not step["preempted"]
            and all(new == 1 for _, new in chunks)
            and any(run["started"] <= step["t"] < run["ended"] for run in runs)
        ):
            out.setdefault(len(chunks), []).append(step["end"] - step["t"])
    return out


def decode_step_ratio(ours: dict[int, list[float]], base: dict[int, list[float]]) -> float | None:
    """How much slower `ours`' plain decode steps ran than `base`'s at the same batch size:
    the ratio of medians per batch size, weighted by the fewer steps of the two. Under
    the connector the same shapes run slower by its per-step work (and by the machine's
    drift between the runs), which the simulator's swap modes do not model."""
    pairs = [
        (float(np.median(ours[n]) / np.median(base[n])), min(len(ours[n]), len(base[n])))
        for n in ours
        if n in base and len(ours[n]) >= 10 and len(base[n]) >= 10
    ]
    if not pairs:
        return None
    return round(sum(r * w for r, w in pairs) / sum(w for _, w in pairs), 4)


def judge_trade(
    setup: FidelitySetup, real: dict[str, Any], trade: dict[str, Any], target: Path
) -> dict[str, Any]:
    """Per codec: the e2e latency and TTFT of the requests plain vLLM preempted (FCFS,
    recompute), each against its own under recompute, paired by request; the mean with a
    95% interval over those requests and over windows (a window's mean); throughput; the
    connector's save and load seconds; and the simulator's prediction of the same
    differences (the engine's swap mode against recompute on the calibrated clock, the same
    requests), also with the swap mode's clock slowed as the connector's decode steps
    were against plain vLLM's."""
    from preempt.calibrate.vllm_steps import read_step_log, slowed_target

    windows = all_windows(setup)
    judged = [n for n in windows if n.startswith("judge")]
    base_log = read_step_log(real["fcfs"]["step_log"])
    base_runs = real["fcfs"]["windows"]
    victims = {n: _preempted(base_log, base_runs[n], n) for n in judged}
    base_real = {n: engine_side(base_log, base_runs[n], n)["records"] for n in judged}
    sent = {n: {r["id"]: r["arrival_s"] for r in base_real[n]} for n in judged}
    base_sim = {n: simulate(setup, "fcfs", target, windows[n], sent[n])["records"] for n in judged}
    base_decode = _decode_steps(base_log, [base_runs[n] for n in judged])
    out: dict[str, Any] = {"preempted": {n: len(v) for n, v in victims.items()}}
    for codec, (_, overrides) in TRADE.items():
        log = read_step_log(trade[codec]["step_log"])
        runs = trade[codec]["windows"]
        records = {n: engine_side(log, runs[n], n)["records"] for n in judged}
        swapped = {
            n: simulate(setup, "fcfs", target, windows[n], sent[n], overrides=overrides)["records"]
            for n in judged
        }
        # The connector's server ran minutes after plain vLLM's, its steps at their own
        # speed (the connector's per-step work, the machine's drift): the prediction again
        # with the swap mode's clock slowed by the ratio measured on same-size decode steps.
        ratio = decode_step_ratio(_decode_steps(log, [runs[n] for n in judged]), base_decode)
        with tempfile.TemporaryDirectory() as scratch:
            slow = slowed_target(target, ratio or 1.0, Path(scratch) / "target.json")
            swapped_at_speed = {
                n: simulate(setup, "fcfs", slow, windows[n], sent[n], overrides=overrides)["records"]
                for n in judged
            }
        row: dict[str, Any] = {"decode_step_ratio": ratio}
        for key in ("e2e_s", "ttft_s"):
            real_diff = [_paired(records[n], base_real[n], victims[n], key) for n in judged]
            sim_diff = [_paired(swapped[n], base_sim[n], victims[n], key) for n in judged]
            at_speed = [_paired(swapped_at_speed[n], base_sim[n], victims[n], key) for n in judged]
            row[key] = {
                "real_by_request": t_interval([v for d in real_diff for v in d])._asdict(),
                "sim_by_request": t_interval([v for d in sim_diff for v in d])._asdict(),
                "real_by_window": t_interval([float(np.mean(d)) for d in real_diff if d])._asdict(),
                "real_pooled": _mean([v for d in real_diff for v in d]),
                "sim_by_window": t_interval([float(np.mean(d)) for d in sim_diff if d])._asdict(),
                "sim_pooled": _mean([v for d in sim_diff for v in d]),
                "sim_at_arm_speed_by_request": t_interval([v for d in at_speed for v in d])._asdict(),
                "base_real_mean": _mean(
                    [r[key] for n in judged for r in base_real[n] if r["id"] in victims[n]]
                ),
                "base_sim_mean": _mean(
                    [r[key] for n in judged for r in base_sim[n] if r["id"] in victims[n]]
                ),
            }
        tokens = [sum(r["tokens"] for r in records[n]) for n in judged]
        spans = [
            max(r["arrival_s"] + r["e2e_s"] for r in records[n]) - min(r["arrival_s"] for r in records[n])
            for n in judged
        ]
        base_spans = [
            max(r["arrival_s"] + r["e2e_s"] for r in base_real[n]) - min(r["arrival_s"] for r in base_real[n])
            for n in judged
        ]
        row["throughput_tok_s"] = {
            "real": [round(t / s, 2) for t, s in zip(tokens, spans, strict=True)],
            "recompute": [round(t / s, 2) for t, s in zip(tokens, base_spans, strict=True)],
        }
        metrics = trade[codec].get("metrics", {})
        for what in ("save", "load"):
            total = metrics.get(f"preempt:kv_{what}_seconds_sum")
            count = metrics.get(f"preempt:kv_{what}_seconds_count")
            row[f"{what}_ms"] = round(1e3 * total / count, 3) if total is not None and count else None
            row[f"{what}s"] = count
        row["fallbacks"] = {k: v for k, v in metrics.items() if k.startswith("preempt:kv_fallbacks")}
        out[codec] = row
    return out


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
    recomputed tokens; per request its latencies as vLLM counts them (from its own arrival
    stamp, set by its API server, to the end of the step that computed the first token,
    and the last); and the API server's delays (the client's send to vLLM's arrival stamp;
    the scheduler's first token to the client's)."""
    since, until = run["started"], run["ended"]
    steps = [s for s in log.steps if since <= s["t"] < until and s["chunks"]]

    def index(engine_id: str) -> int | None:
        return window_index(engine_id, window)

    added = {index(a["id"]): a for a in log.adds if index(a["id"]) is not None}
    finished = {index(f["id"]): f for f in log.finishes if index(f["id"]) is not None}
    first_token: dict[int, float] = {}
    preemptions = recomputed = 0
    for step in steps:
        for engine_id, (before, new) in zip(step["ids"], step["chunks"], strict=True):
            i = index(engine_id)
            if i is not None and i not in first_token and before + new >= added[i]["prompt"]:
                first_token[i] = step["end"]
        for engine_id, tokens in step["preempted"]:
            if index(engine_id) is not None:
                preemptions += 1
                recomputed += tokens
    records = [
        {
            "id": i,
            "priority": added[i]["priority"],
            "arrival_s": added[i]["arrival"] - since,
            "ttft_s": first_token[i] - added[i]["arrival"],
            "e2e_s": finished[i]["t"] - added[i]["arrival"],
            "tokens": finished[i]["tokens"],
        }
        for i in sorted(added)
        if i in first_token and i in finished
    ]
    sent = {r["id"]: r["sent_wall"] for r in run["records"]}
    client_first = {r["id"]: r["sent_wall"] + r["ttft_s"] for r in run["records"]}
    return {
        "records": records,
        "steps": len(steps),
        "preemptions": preemptions,
        "recomputed_tokens": recomputed,
        "api_in_s": _percentiles([added[i]["arrival"] - sent[i] for i in sent if i in added]),
        "api_out_s": _percentiles(
            [client_first[i] - first_token[i] for i in client_first if i in first_token]
        ),
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
    peer_python: Path,
    work_dir: Path,
    quick: bool = False,
    setup: FidelitySetup | None = None,
    connector: bool = False,
) -> dict[str, Any]:
    """The whole loop (module docstring): the real runs (`serve_interleaved`; kept in
    `work_dir`: the step logs, the client's records in real.json, the servers' logs), with
    `connector` also the judge windows through preempt's KV connector, then
    `judge_fidelity`."""
    setup = setup or (QUICK if quick else FidelitySetup())
    work_dir.mkdir(parents=True, exist_ok=True)
    windows = all_windows(setup)
    started = time.perf_counter()
    arms = real_arms(setup, connector)
    served = serve_interleaved(peer_python, work_dir, setup, arms, windows)
    real = {arm.name: served[arm.name] for arm in arms if not arm.judge_only}
    trade = {codec: served[f"fcfs_{codec}"] for codec in TRADE} if connector else None
    elapsed = round(time.perf_counter() - started, 1)
    # the swap modes' copy rate, measured once with the runs: judging again is deterministic
    copy_rate = host_copy_rate()
    kept = {
        "setup": asdict(setup),
        "real": real,
        "trade": trade,
        "real_s": elapsed,
        "host_copy_bytes_per_s": copy_rate,
    }
    (work_dir / "real.json").write_text(json.dumps(kept) + "\n")
    return judge_fidelity(setup, real, work_dir, trade, elapsed, copy_rate)


def all_windows(setup: FidelitySetup) -> dict[str, list[WindowRequest]]:
    """`fit<k>` and `judge<k>` windows, by name, in the order they run (the trace's)."""
    names = {f"fit{k}": s for k, s in enumerate(setup.fit_starts)}
    names.update({f"judge{k}": s for k, s in enumerate(setup.judge_starts)})
    ordered = sorted(names.items(), key=lambda kv: kv[1])
    return {name: window_requests(setup, start) for name, start in ordered}


def read_kept(work_dir: Path) -> dict[str, Any]:
    """The real runs a bench left in `work_dir` (real.json, plain or gzipped), each arm's
    step log found beside it (plain or gzipped): the folder may have moved."""
    packed = work_dir / "real.json.gz"
    if packed.is_file() and not (work_dir / "real.json").is_file():
        import gzip

        data = json.loads(gzip.decompress(packed.read_bytes()))
    else:
        data = json.loads((work_dir / "real.json").read_text())
    for arms in (data["real"], data.get("trade") or {}):
        for arm in arms.values():
            if isinstance(arm, dict) and "step_log" in arm:
                name = Path(arm["step_log"]).name
                here = [work_dir / name, work_dir / f"{name}.gz"]
                arm["step_log"] = str(next((p for p in here if p.is_file()), here[0]))
    return data


def rejudge(work_dir: Path) -> dict[str, Any]:
    """`judge_fidelity` again on the real runs a bench left in `work_dir` (`read_kept`)."""
    data = read_kept(work_dir)
    setup = data["setup"]
    setup = FidelitySetup(**{**setup, **{k: tuple(v) for k, v in setup.items() if isinstance(v, list)}})
    copy_rate = data.get("host_copy_bytes_per_s") or host_copy_rate()  # older runs did not keep it
    return judge_fidelity(setup, data["real"], work_dir, data.get("trade"), data.get("real_s"), copy_rate)


def judge_fidelity(
    setup: FidelitySetup,
    real: dict[str, Any],
    work_dir: Path,
    trade: dict[str, Any] | None = None,
    real_s: float | None = None,
    copy_rate: float | None = None,
) -> dict[str, Any]:
    """Calibration on the fit windows, simulated runs of the judge windows, the
    comparison per policy (and the connector's trade, `judge_trade`, when it ran)."""
    from preempt.calibrate.vllm_steps import calibrate_vllm, errors, read_step_log, shape_of, timed_steps
    from preempt.core.cost_model import CostModel
    from preempt.core.profiles import load_target

    windows = all_windows(setup)
    names = list(windows)

    # calibrate: every policy's steps inside the fit windows
    fit_spans = [
        (real[p]["windows"][n]["started"], real[p]["windows"][n]["ended"])
        for p in setup.policies
        for n in names
        if n.startswith("fit")
    ]
    logs = [real[p]["step_log"] for p in setup.policies]
    copy = None if copy_rate is None else (copy_rate, COPY_SOURCE)
    profile = calibrate_vllm(logs, name=f"vllm-cpu-{setup.preset}", windows=fit_spans, copy=copy)
    target = work_dir / "target.json"
    target.write_text(json.dumps(profile, indent=1) + "\n")
    cost = CostModel(load_target(target))

    judged = [n for n in names if n.startswith("judge")]
    fitted = [n for n in names if n.startswith("fit")]
    policies: dict[str, Any] = {}
    for policy in setup.policies:
        log = read_step_log(real[policy]["step_log"])
        runs = real[policy]["windows"]
        # the API server's delays, measured on the fit windows (means over their requests)
        fit_sides = [engine_side(log, runs[name], name) for name in fitted]
        frontend = (
            float(np.mean([e["api_in_s"]["mean"] for e in fit_sides])),
            float(np.mean([e["api_out_s"]["mean"] for e in fit_sides])),
        )
        server_w, client_w, sim_w, sim_client_w, engine_w, sim_runs = [], [], [], [], [], []
        for name in judged:
            side = engine_side(log, runs[name], name)
            arrivals = {r["id"]: r["arrival_s"] for r in side["records"]}
            sim = simulate(setup, policy, target, windows[name], arrivals)
            client = real_records(runs[name])
            sent = {r["id"]: r["arrival_s"] for r in client}
            server_w.append(side["records"])
            client_w.append(client)
            sim_w.append(sim["records"])
            sim_client_w.append(simulate(setup, policy, target, windows[name], sent, frontend)["records"])
            sim_runs.append(sim)
            engine_w.append(side)
        by_window = [
            [(shape_of(step), s) for step, s in timed_steps(log, runs[name]["started"], runs[name]["ended"])]
            for name in judged
        ]
        judge_steps = [pair for pairs in by_window for pair in pairs]
        tokens = [sum(r["tokens"] for r in w) for w in server_w]
        span_real = [
            max(r["arrival_s"] + r["e2e_s"] for r in w) - min(r["arrival_s"] for r in w) for w in server_w
        ]
        policies[policy] = {
            "server": compare(server_w, sim_w),
            "client": compare(client_w, sim_client_w),
            "frontend_s": {"to_engine": round(frontend[0], 5), "to_client": round(frontend[1], 5)},
            "steps": _count_error([e["steps"] for e in engine_w], [s["steps"] for s in sim_runs]),
            "preemptions": _count_error(
                [e["preemptions"] for e in engine_w], [s["preemptions"] for s in sim_runs]
            ),
            "recomputed_tokens": _count_error(
                [e["recomputed_tokens"] for e in engine_w], [s["recomputed_tokens"] for s in sim_runs]
            ),
            "throughput_tok_s": _count_error(
                [round(t / s, 2) for t, s in zip(tokens, span_real, strict=True)],
                [round(t / s["makespan_s"], 2) for t, s in zip(tokens, sim_runs, strict=True)],
            ),
            "sources": {
                "step_formula_on_judge_steps": errors(cost, judge_steps),
                # the clock's drift window by window: how far the machine's speed moved
                "sum_ratio_by_window": [errors(cost, pairs).get("sum_ratio") for pairs in by_window],
                "api_in_s": [e["api_in_s"] for e in engine_w],
                "api_out_s": [e["api_out_s"] for e in engine_w],
            },
            "requests": [len(w) for w in server_w],
        }
    out = {
        "setup": asdict(setup),
        "windows": {n: len(w) for n, w in windows.items()},
        "profile": {"path": str(target), "fit": profile["fit"]},
        "policies": policies,
        "real_s": real_s,
        "commands": {p: real[p]["command"] for p in setup.policies},
    }
    if trade is not None:
        out["trade"] = judge_trade(setup, real, trade, target)
        out["commands"].update({f"fcfs_{codec}": trade[codec]["command"] for codec in trade})
    return out


# ----------------------------------------------------------------------- the table
def render_fidelity(result: dict[str, Any]) -> str:
    """The comparison as Markdown: per policy, each latency's real and simulated values
    and the relative error (pooled over the judge windows; the mean over windows with its
    95% interval), then the run totals and where the error comes from."""
    setup = result["setup"]
    fit = result["profile"]["fit"]
    lines = [
        f"vLLM {setup['preset']} model, {setup['trace']} windows of {setup['window_s']:g} s at rate x"
        f"{setup['rate_scale']:g}, lengths x{setup['length_scale']:g}; judged on "
        f"{sum(1 for n in result['windows'] if n.startswith('judge'))} windows the profile was not fitted on",
        f"profile: {result['profile']['path']} ({fit['steps']} steps, RMS log error {fit['rms_log']})",
    ]
    for policy, row in result["policies"].items():
        front = row["frontend_s"]
        lines += [
            "",
            f"### vllm_{policy} ({sum(row['requests'])} requests)",
            "",
            "Latencies as vLLM counts them (from its arrival stamp to the step's end):",
            "",
            "| | real | sim | error | error by window (95%) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for metric in METRICS:
            for stat in STATS:
                cell = row["server"][metric][stat]
                w = cell["error_by_window"]
                lines.append(
                    f"| {metric.removesuffix('_s').upper()} {stat} | {cell['real']:.3f} s "
                    f"| {cell['sim']:.3f} s "
                    f"| {cell['error']:+.1%} | {w['mean']:+.1%} [{w['lo']:+.1%}, {w['hi']:+.1%}] |"
                )
        for key in ("steps", "preemptions", "recomputed_tokens", "throughput_tok_s"):
            c = row[key]
            error = "n/a" if c["error"] is None else f"{c['error']:+.1%}"
            lines.append(f"| {key.replace('_', ' ')} | {sum(c['real']):g} | {sum(c['sim']):g} | {error} | |")
        client = row["client"]
        formula = row["sources"]["step_formula_on_judge_steps"]
        lines += [
            "",
            "Seen by the HTTP client (the simulator adds the API server's mean delays measured on "
            f"the fit windows, {front['to_engine'] * 1e3:.1f} ms in and "
            f"{front['to_client'] * 1e3:.1f} ms out): "
            + ", ".join(
                f"{m.removesuffix('_s').upper()} mean {client[m]['mean']['real']:.3f} s real, "
                f"{client[m]['mean']['sim']:.3f} s sim ({client[m]['mean']['error']:+.1%})"
                for m in METRICS
            )
            + ".",
            "",
            f"The step formula on the judge windows' own {formula['steps']} steps: RMS log error "
            f"{formula['rms_log']}, predicted / measured sum {formula['sum_ratio']} (window by window: "
            + ", ".join(f"{r:.3f}" for r in row["sources"]["sum_ratio_by_window"])
            + ").",
        ]
    if "trade" in result:
        lines += render_trade(result["trade"])
    return "\n".join(lines)


def _interval(cell: dict[str, Any]) -> str:
    if cell["num"] == 0:
        return "n/a"
    if cell["num"] < 2:
        return f"{cell['mean']:+.3f} s (one window)"
    return f"{cell['mean']:+.3f} [{cell['lo']:+.3f}, {cell['hi']:+.3f}] s"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"x{value:.3f}"


def render_trade(trade: dict[str, Any]) -> list[str]:
    """The connector against recompute, on the requests plain vLLM preempted."""
    lines = [
        "",
        f"### The seed's trade: preempt's KV connector against recompute (vLLM FCFS; "
        f"{sum(trade['preempted'].values())} requests preempted under recompute)",
        "",
        "| codec | e2e under recompute, real / sim | e2e change, real (95%, over requests) | "
        "e2e change, sim | TTFT change, real | TTFT change, sim | e2e change over windows, real | "
        "save / load ms | throughput tok/s (recompute) | decode step vs recompute's | "
        "e2e change, sim at that speed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for codec in TRADE:
        if codec not in trade:
            continue
        row = trade[codec]
        e2e, ttft, tput = row["e2e_s"], row["ttft_s"], row["throughput_tok_s"]
        save = "n/a" if row["save_ms"] is None else f"{row['save_ms']:.1f} / {row['load_ms'] or 0:.1f}"
        base = (
            "n/a"
            if e2e["base_real_mean"] is None
            else f"{e2e['base_real_mean']:.2f} / {e2e.get('base_sim_mean') or 0:.2f} s"
        )
        lines.append(
            f"| {codec} | {base} | {_interval(e2e['real_by_request'])} "
            f"| {_interval(e2e['sim_by_request'])} | {_interval(ttft['real_by_request'])} "
            f"| {_interval(ttft['sim_by_request'])} | {_interval(e2e['real_by_window'])} | {save} "
            f"| {sum(tput['real']):.0f} ({sum(tput['recompute']):.0f}) "
            f"| {_ratio(row.get('decode_step_ratio'))} | {_interval(e2e['sim_at_arm_speed_by_request'])} |"
        )
    return lines
