"""`preempt bench vllm --http --connector`: preempt's KV connector in a real `vllm serve`.

The same requests, under forced preemptions (every request sent within the first half
second to a pool of 24 blocks of 32 tokens and 8 seats), through one `vllm serve` per arm
(the peer's, on the tiny local byte-level Llama of `bench vllm --http`): plain vLLM, which
preempts by recompute; the plugin without the connector; and the plugin with the
connector in raw and mixed modes, with and without early copies, and with copies only
where the cost rule chooses them (`saves: cost`, each choice judged: `judge_cost`). Two regimes: `long`
prompts (224 tokens: recomputing a victim costs a long prefill, its copy a few hundred KB)
and `short` ones (32 tokens), 128 output tokens each. Per arm and regime: tokens
recomputed (the preempted tokens not loaded back; the plain arm's connector only counts
them), the connector's saves, loads and fallbacks, mean request latency, TTFT and longest
wait between streamed chunks (where a resumed request's stall shows: the client cannot
tell which requests were preempted), output throughput, wall time, and greedy outputs
against plain vLLM's; the summary gives each a mean with a 95% t-interval over seeds and
its difference from plain vLLM paired by seed (`connector_table`).
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
from typing import Any

import httpx

from preempt.bench.vllm_http import (
    ENGINE,
    HttpRequest,
    ServeArm,
    _free_port,
    drive,
    serve_command,
    vllm_server,
    write_model,
)
from preempt.integrations.vllm.kv_store import kv_transfer_config
from preempt.obs.stats import t_interval


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
    # InferCept's rule: a victim is saved only while copying is measured cheaper than
    # recomputing (judged against the `plugin_raw` and `plugin` arms: `judge_cost`)
    ConnectorArm(
        "plugin_raw_cost",
        ServeArm("plugin_raw_cost", "priority", plugin=True),
        {"codec": "raw", "saves": "cost"},
    ),
)
COST_ARM, SAVE_ALL_ARM, RECOMPUTE_ARM = "plugin_raw_cost", "plugin_raw", "plugin"

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
    (labelled ones as `name{label=value}`, preempt's labels `reason` and `choice`), summed
    over vLLM's engine labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10.0).text):
        for sample in family.samples:
            if sample.name in VLLM_COUNTERS or sample.name.startswith("preempt:kv_"):
                own = {k: v for k, v in sample.labels.items() if k in ("reason", "choice")}
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


# --------------------------------------------------------------------- summary
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
    regimes = {regime: summarize_connector(results, regime) for regime in REGIMES}
    return {
        "workload": {"seeds": num_seeds, "requests": num, "prompt_tokens": REGIMES, "engine": engine},
        "regimes": regimes,
        "cost": {regime: judge_cost(arms) for regime, arms in regimes.items() if COST_ARM in arms},
        "commands": {result["name"]: result["command"] for result in results},
    }


def _per_token(counters: dict[str, float], seconds: str, tokens: str) -> float | None:
    total, count = counters.get(seconds), counters.get(tokens)
    return total / count if total is not None and count else None


def _rates(counters: dict[str, float]) -> dict[str, float | None]:
    """Seconds per token of a save, a load and a prefill-bound step, from an arm's counters."""
    return {
        "save": _per_token(counters, "preempt:kv_save_seconds_sum", "preempt:kv_saved_tokens_total"),
        "load": _per_token(counters, "preempt:kv_load_seconds_sum", "preempt:kv_loaded_tokens_total"),
        "recompute": _per_token(
            counters, "preempt:kv_prefill_seconds_total", "preempt:kv_prefill_tokens_total"
        ),
    }


def judge_cost(arms: dict[str, Any]) -> dict[str, Any]:
    """The cost rule's choices (`saves: cost`), each judged against what saving and
    recomputing cost on the same requests: a save and a load per token where every victim
    was saved (`SAVE_ALL_ARM`), a prefill per token where every victim was recomputed
    (`RECOMPUTE_ARM`). Every choice is per token on both sides, so the cheaper side is one
    for all of them: a choice is right when it took that side (a save before the rule had
    measured both sides counts as a save). Also the rates the cost arm itself measured."""
    choices = {
        choice: int(arms[COST_ARM]["counters"].get(f"preempt:kv_cost_choices_total{{choice={choice}}}", 0))
        for choice in ("save", "recompute", "unmeasured")
    }
    saved = arms.get(SAVE_ALL_ARM, {}).get("counters", {})
    recomputed = arms.get(RECOMPUTE_ARM, {}).get("counters", {})
    judged = {
        "save": _rates(saved)["save"],
        "load": _rates(saved)["load"],
        "recompute": _rates(recomputed)["recompute"],
    }
    out: dict[str, Any] = {
        "choices": choices,
        "rates_s_per_token": judged,
        "own_rates_s_per_token": _rates(arms[COST_ARM]["counters"]),
    }
    if None in judged.values():
        out["cheaper"] = None
        return out
    cheaper = "save" if judged["save"] + judged["load"] < judged["recompute"] else "recompute"
    right = choices["recompute"] if cheaper == "recompute" else choices["save"] + choices["unmeasured"]
    out.update(cheaper=cheaper, right=right, wrong=sum(choices.values()) - right)
    return out


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
        cost = summary.get("cost", {}).get(regime)
        if cost is not None:
            rates, choices = cost["rates_s_per_token"], cost["choices"]
            us = {k: "–" if v is None else f"{1e6 * v:.1f}" for k, v in rates.items()}
            verdict = (
                "no verdict: a side was not measured"
                if cost["cheaper"] is None
                else f"cheaper: {cost['cheaper']}; right {cost['right']}, wrong {cost['wrong']}"
            )
            lines += [
                "",
                f"`saves: cost` chose save {choices['save']}, recompute {choices['recompute']}, "
                f"save unmeasured {choices['unmeasured']} times; per token, save {us['save']} + load "
                f"{us['load']} us ({SAVE_ALL_ARM}) against recompute {us['recompute']} us ({RECOMPUTE_ARM}): "
                f"{verdict}",
            ]
        lines.append("")
    return "\n".join(lines)
