"""`preempt bench vllm --http --connector`: preempt's KV connector in a real `vllm serve`.

The same requests, under forced preemptions (every request sent within the first half
second to a pool of 24 blocks of 32 tokens and 8 seats), through one `vllm serve` per arm
(the peer's, on the tiny local byte-level Llama of `bench vllm --http`): plain vLLM, which
preempts by recompute; the plugin without the connector; and the plugin with the
connector in raw and mixed modes, with and without early copies. Two regimes: `long`
prompts (224 tokens: recomputing a victim costs a long prefill, its copy a few hundred KB)
and `short` ones (32 tokens), 128 output tokens each. Per arm and regime: tokens
recomputed (the preempted tokens not loaded back; the plain arm's connector only counts
them), the connector's saves, loads and fallbacks, mean request latency, TTFT and longest
wait between streamed chunks (where a resumed request's stall shows: the client cannot
tell which requests were preempted), output throughput, wall time, and greedy outputs
against plain vLLM's. Intervals over seeds are experiments/vllm_connector.py's.
This module never imports vLLM; the servers are subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from preempt.bench.vllm_http import (
    ENGINE,
    HttpRequest,
    ServeArm,
    _free_port,
    drive,
    serve_command,
    vllm_server,
)
from preempt.integrations.vllm.kv_store import kv_transfer_config


@dataclass(frozen=True)
class ConnectorArm:
    name: str
    serve: ServeArm
    connector: dict | None = field(default=None)  # ConnectorSettings fields; None: no connector


CONNECTOR_ARMS = (
    # vLLM's own scheduler and recompute; the connector only counts the tokens dropped
    # (`saves: none`; the same steps and outputs as without it: tests/integrations)
    ConnectorArm("vllm", ServeArm("vllm", "fcfs"), {"saves": "none"}),
    ConnectorArm("plugin", ServeArm("plugin", "priority", plugin=True), {"saves": "none"}),
    ConnectorArm("plugin_raw", ServeArm("plugin_raw", "priority", plugin=True), {"codec": "raw"}),
    ConnectorArm("plugin_mixed", ServeArm("plugin_mixed", "priority", plugin=True), {"codec": "mixed"}),
    ConnectorArm(
        "plugin_raw_early",
        ServeArm("plugin_raw_early", "priority", plugin=True),
        {"codec": "raw", "early": True},
    ),
)

REGIMES = {"long": 224, "short": 32}  # prompt tokens (bytes) per request
OUTPUT_TOKENS = 128

VLLM_COUNTERS = ("vllm:num_preemptions_total",)


def forced_preemptions(regime: str, num: int = 16, seed: int = 0) -> list[HttpRequest]:
    """`num` requests of one priority, one every 30 ms, prompts of `REGIMES[regime]`
    printable bytes (one byte, one token), `OUTPUT_TOKENS` each."""
    rng = random.Random(seed)
    length = REGIMES[regime]
    return [
        HttpRequest(
            i, 0, 0.03 * i, "".join(chr(rng.randrange(32, 127)) for _ in range(length)), OUTPUT_TOKENS
        )
        for i in range(num)
    ]


def connector_command(
    vllm_bin: Path, model_dir: Path, port: int, arm: ConnectorArm, engine: dict
) -> list[str]:
    command = serve_command(vllm_bin, model_dir, port, arm.serve, engine)
    if arm.connector is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config(arm.connector))]
    return command


def scrape_counters(url: str) -> dict[str, float]:
    """vLLM's `VLLM_COUNTERS` and preempt's `preempt:kv_*` families from `/metrics`
    (labelled ones as `name{label=value}`), summed over vLLM's engine labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10.0).text):
        for sample in family.samples:
            if sample.name in VLLM_COUNTERS or sample.name.startswith("preempt:kv_"):
                own = {k: v for k, v in sample.labels.items() if k == "reason"}
                key = sample.name + "".join(f"{{{k}={v}}}" for k, v in own.items())
                values[key] = values.get(key, 0.0) + sample.value
    return values


def recomputed_tokens(counters: dict[str, float]) -> float:
    """Tokens of KV the preemptions dropped and vLLM computed again: every preempted
    token the connector did not load back (vLLM's counters do not separate a resumed
    prefill from a first one: `vllm:iteration_tokens_total` is prompts plus outputs)."""
    return counters.get("preempt:kv_preempted_tokens_total", 0.0) - counters.get(
        "preempt:kv_loaded_tokens_total", 0.0
    )


def run_connector_arms(
    vllm_bin: Path,
    model_dir: Path,
    arms: Sequence[ConnectorArm],
    workloads: dict[str, Sequence[Sequence[HttpRequest]]],
    log_dir: Path,
    engine: dict = ENGINE,
) -> list[dict]:
    """One `vllm serve` per arm, one at a time, warmed up, then every regime's workloads
    in turn; per workload the client's records and the counters' deltas."""
    results = []
    for arm in arms:
        command = connector_command(vllm_bin, model_dir, _free_port(), arm, engine)
        with vllm_server(command, log_dir / f"connector-{arm.name}.log") as server:
            asyncio.run(drive(server.url, forced_preemptions("short", num=4, seed=-1)))  # one-time costs
            runs: dict[str, list[dict]] = {}
            for regime, requests_by_seed in workloads.items():
                for requests in requests_by_seed:
                    before = scrape_counters(server.url)
                    started = time.perf_counter()
                    records = asyncio.run(drive(server.url, requests))
                    wall_s = time.perf_counter() - started
                    after = scrape_counters(server.url)
                    delta = {k: after[k] - before.get(k, 0.0) for k in after}
                    runs.setdefault(regime, []).append(
                        {
                            "wall_s": wall_s,
                            "recomputed_tokens": recomputed_tokens(delta),
                            "counters": delta,
                            "latency_s": sum(r["latency_s"] for r in records) / len(records),
                            "ttft_s": sum(r["ttft_s"] for r in records) / len(records),
                            "max_gap_s": sum(r["max_gap_s"] for r in records) / len(records),
                            "output_tokens_per_s": sum(len(r["token_ids"]) for r in records) / wall_s,
                            "requests": sorted(records, key=lambda r: r["id"]),
                        }
                    )
        results.append({"name": arm.name, "command": command, "runs": runs, "exit_code": server.returncode})
    return results
