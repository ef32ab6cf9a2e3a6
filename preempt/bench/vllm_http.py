"""`preempt bench vllm --http`: the plugin in a real `vllm serve`, driven over HTTP.

Each arm starts the peer's own `vllm serve` CLI (`make peer`: vLLM 0.32.0's CPU build with
preempt installed into it) on a tiny local byte-level Llama (`random_llama`'s `served`,
no download), sends the same requests with the openai client on the wall clock (streamed
`/v1/completions`, greedy, vLLM's `priority` field), scrapes `/metrics`, and stops the
server with SIGTERM. Arms: vLLM fcfs, vLLM `--scheduling-policy priority`, and the plugin
(`--scheduler-cls ...PreemptScheduler`, its default settings). Per arm: TTFT per priority
class, wall time, vLLM's `vllm:num_preemptions_total` beside the plugin's `preempt:*`
families, and every request's output token ids (greedy: a policy changes order, never
tokens); the summary (`summarize_http`) gives top-class TTFT with 95% intervals over
seeds, paired by seed against vLLM priority. This module never imports vLLM; the servers
are subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from preempt.bench.vllm import mean_by_priority
from preempt.integrations.vllm.settings import PLUGIN_CLS
from preempt.obs.stats import t_interval
from preempt.parity.harness import PeerError

TOP_PRIORITY, LOW_PRIORITY = 0, 3  # vLLM's priority: smaller is more important
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServeArm:
    name: str
    policy: str  # vLLM's --scheduling-policy: fcfs | priority
    plugin: bool = False
    settings: dict = field(default_factory=dict)  # the plugin's --additional-config "preempt"


ARMS = (
    ServeArm("vllm_fcfs", "fcfs"),
    ServeArm("vllm_priority", "priority"),
    ServeArm("plugin", "priority", plugin=True),
)

# The engine shape of `preempt bench vllm`'s in-process run: 24 KV blocks of 32 tokens
# (vLLM's CPU attention needs multiples of 32), 8 seats, no prefix cache.
ENGINE = {"block_size": 32, "num_gpu_blocks": 24, "max_model_len": 512, "max_num_seqs": 8,
          "max_num_batched_tokens": 256}  # fmt: skip


@dataclass(frozen=True)
class HttpRequest:
    id: int
    priority: int
    at_s: float  # sent this long after the run starts
    prompt: str | list[int]  # text, or token ids as they are
    max_tokens: int
    request_id: str | None = None  # vLLM's request id (within its own): lines up with its logs


@dataclass(frozen=True)
class Shape:
    """When and how long the two classes' requests are: `num_low` of priority 3 sent
    every `low_every_s` from 0 with `low_max_tokens` each, then `num_high` of priority 0
    every `high_every_s` from `high_start_s` (None: right after the last low one)."""

    low_max_tokens: int
    low_every_s: float
    high_every_s: float
    high_start_s: float | None = None


SHAPES = {
    # The first run: short low requests, the urgent class right behind them.
    "mixed": Shape(low_max_tokens=48, low_every_s=0.02, high_every_s=0.1),
    # Long low requests that keep the pool under memory pressure for the whole run (forced
    # preemptions all along), the urgent class trickling in from 3 s: where the plugin once
    # lost to vLLM's own priority scheduling (docs/vllm_plugin.md).
    "priority": Shape(low_max_tokens=200, low_every_s=0.02, high_every_s=0.4, high_start_s=3.0),
}


def http_workload(
    num_low: int = 60, num_high: int = 20, seed: int = 0, shape: str = "mixed"
) -> list[HttpRequest]:
    """The issue's run (`SHAPES[shape]`): `num_low` requests of priority 3 fill the pool,
    then `num_high` of priority 0 arrive while it is full. Prompts are printable ASCII (one
    byte, one token; 96 bytes low, 64 high), different per request, from `seed`."""
    import random

    form = SHAPES[shape]
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(n))

    low = [
        HttpRequest(i, LOW_PRIORITY, form.low_every_s * i, text(96), form.low_max_tokens)
        for i in range(num_low)
    ]
    start = form.low_every_s * num_low if form.high_start_s is None else form.high_start_s
    high = [
        HttpRequest(1000 + j, TOP_PRIORITY, start + form.high_every_s * j, text(64), 16)
        for j in range(num_high)
    ]
    return low + high


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(
    vllm_bin: Path,
    model_dir: Path,
    port: int,
    arm: ServeArm,
    engine: dict = ENGINE,
    extra: Sequence[str] = (),
) -> list[str]:
    """`vllm serve` as a user types it (docs/vllm_plugin.md), plus the tiny engine's shape
    and `extra` arguments."""
    command = [
        str(vllm_bin), "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--dtype", engine.get("dtype", "bfloat16"), "--enforce-eager", "--seed", "0",
        "--no-enable-prefix-caching",
        "--block-size", str(engine["block_size"]),
        "--num-gpu-blocks-override", str(engine["num_gpu_blocks"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--scheduling-policy", arm.policy,
        # first token at once, then 16 at a time: on 2 shared cores per-token SSE for 80
        # streams made the API server, not the scheduler, decide who waited (TTFT spread
        # 0.03-2.7 s between seeds of one arm)
        "--stream-interval", "16",
    ]  # fmt: skip
    if arm.plugin:
        command += ["--scheduler-cls", PLUGIN_CLS]
        command += ["--additional-config", json.dumps({"preempt": arm.settings})]
    return command + list(extra)


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPT_VLLM", "PROMETHEUS_MULTIPROC"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; vLLM's CPU backend would otherwise reserve most of RAM
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)  # the peer runs its installed preempt, as a user's would
    return env


class ServerError(PeerError):
    """`vllm serve` exited or never became healthy; the message holds its log's tail."""


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    returncode: int | None = None  # set when stopped


@contextlib.contextmanager
def vllm_server(
    command: Sequence[str],
    log_path: Path,
    timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> Iterator[Server]:
    """Start `command` (`server_env()` and `env`; on `cpus` only, if given), wait for GET
    /health, yield the server; SIGTERM on exit (vLLM's graceful shutdown), SIGKILL after
    60 s. Raises ServerError with the log's tail."""
    port = command[command.index("--port") + 1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_env(), **(env or {})},
            start_new_session=True,
            preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerError(f"vllm serve exited {proc.returncode}:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerError(f"vllm serve not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.5)
        yield server
    finally:
        server.returncode = stop_server(proc)


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def _one(client, request: HttpRequest, started: float) -> dict:
    await asyncio.sleep(max(0.0, started + request.at_s - time.perf_counter()))
    sent, sent_wall = time.perf_counter(), time.time()
    first = last = None
    longest_gap = 0.0  # the longest wait between two streamed chunks: a resume's stall shows here
    token_ids: list[int] = []
    extra = {"priority": request.priority, "ignore_eos": True, "return_token_ids": True}
    if request.request_id is not None:
        extra["request_id"] = request.request_id
    stream = await client.completions.create(
        model="tiny",
        prompt=request.prompt,
        max_tokens=request.max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra,
    )
    async for chunk in stream:
        ids = getattr(chunk.choices[0], "token_ids", None) if chunk.choices else None
        if ids:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                longest_gap = max(longest_gap, now - last)
            last = now
            token_ids.extend(ids)
    done = time.perf_counter()
    return {
        "id": request.id,
        "priority": request.priority,
        "sent_s": sent - started,
        "sent_wall": sent_wall,  # time.time(): the servers' logs are on this clock
        "ttft_s": (first or done) - sent,
        "latency_s": done - sent,
        "max_gap_s": longest_gap,
        "token_ids": token_ids,
    }


async def drive(url: str, requests: Sequence[HttpRequest]) -> list[dict]:
    """Every request at its time, concurrently, through the openai client."""
    from openai import AsyncOpenAI

    # No keep-alive: a pooled connection idle for the server's keep-alive timeout (5 s in
    # vLLM) can be closed by the server just as the client reuses it, and a request then
    # fails with a connection error; a fresh localhost connection per request costs ~nothing.
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600.0)
    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600.0, http_client=http
    ) as client:
        started = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, r, started) for r in requests)))


def scrape(url: str) -> dict[str, float]:
    """`/metrics` samples of vLLM's preemption counter and preempt's families, by name
    (with the label, if any, as `name{label=value}`), summed over vLLM's engine labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_preemptions_total" or sample.name.startswith("preempt:"):
                own = {k: v for k, v in sample.labels.items() if k in ("reason", "failure")}
                key = sample.name + "".join(f"{{{k}={v}}}" for k, v in own.items())
                values[key] = values.get(key, 0.0) + sample.value
    return values


# Pinning, where the model's forward pass is the load (the fidelity bench's 25M model;
# not this bench's tiny one, `run_arms`): the model on core 0 alone, everything else
# (vLLM's engine core and API server, the client) on the other cores, in every arm. Left
# to itself vLLM's CPU backend binds only its model worker and reserves one core for the
# rest, two with a KV connector: with two cores in all it then gave the connector's model
# both (its steps ran twice as fast as plain vLLM's), and nothing kept the API server and
# the client off the model's core (the same step shapes ran up to 14% slower in one window
# than the next; pinned, the calibrated clock's error per window fell from 0.87-1.06 to
# 0.97-1.08: docs/fidelity.md).
MODEL_CPU = 0
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": str(MODEL_CPU)}


def other_cpus() -> set[int] | None:
    """Every core this process may use but the model's (None on a single core)."""
    others = os.sched_getaffinity(0) - {MODEL_CPU}
    return others or None


@contextlib.contextmanager
def pinned_client() -> Iterator[set[int] | None]:
    """This process (the client) off the model's core while the block runs; yields the
    cores the servers' other processes get (`other_cpus`)."""
    cpus, mine = other_cpus(), os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, mine)


# vLLM's engine core and worker busy-wait on their message queue for 1 s after the last
# message (`vllm/distributed/device_communicators/shm_broadcast.py`): a server just
# drained spins that long on both cores, so the next arm starts after it has gone quiet.
QUIET_S = 1.5


def run_arms(
    vllm_bin: Path,
    model_dir: Path,
    arms: Sequence[ServeArm],
    workloads: Sequence[Sequence[HttpRequest]],
    log_dir: Path,
    engine: dict = ENGINE,
) -> list[dict]:
    """Every arm's `vllm serve` up at once, each warmed up; then the workloads in turn,
    each through every arm one after the other (each drains, then `QUIET_S` passes,
    before the next), the arms' order reversed every other workload, so the machine's
    drift falls on every arm alike and a workload's arms are paired in time. Not pinned:
    with this tiny model the serving stack (engine core, API server, client), not the
    model, is the load; pinning the model to a core of its own left the rest one core and
    every arm's TTFT grew 2-5x (benchmarks/vllm_http_2026-12-08_pinned.json). Per arm: per
    workload its records, mean TTFT per class and the counters it moved (`/metrics` after
    it minus before it), the scrape at the end (counters over warm-up and all workloads),
    the exit code."""
    out: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for arm in arms:
            command = serve_command(vllm_bin, model_dir, _free_port(), arm, engine)
            started = time.perf_counter()
            server = stack.enter_context(vllm_server(command, log_dir / f"{arm.name}.log"))
            up_s = time.perf_counter() - started
            # a server's first requests pay one-time costs: not measured
            asyncio.run(drive(server.url, http_workload(num_low=8, num_high=2, seed=-1)))
            servers[arm.name] = server
            out[arm.name] = {"name": arm.name, "command": command, "start_s": round(up_s, 1), "runs": [],
                             "metrics": scrape(server.url), "pid": server.proc.pid}  # fmt: skip
        for turn, requests in enumerate(workloads):
            for arm in reversed(arms) if turn % 2 else arms:
                server, mine = servers[arm.name], out[arm.name]
                time.sleep(QUIET_S)
                run_started = time.perf_counter()
                records = asyncio.run(drive(server.url, requests))
                before, mine["metrics"] = mine["metrics"], scrape(server.url)
                mine["runs"].append(
                    {
                        "wall_s": round(time.perf_counter() - run_started, 2),
                        "ttft_s": mean_by_priority(records, lambda r: r["ttft_s"]),
                        "requests": sorted(records, key=lambda r: r["id"]),
                        "metrics": {k: v - before.get(k, 0.0) for k, v in mine["metrics"].items()},
                    }
                )
    for arm in arms:
        out[arm.name]["exit_code"] = servers[arm.name].returncode
    return [out[arm.name] for arm in arms]


def write_model(peer_python: Path, model_dir: Path, preset: str = "served") -> Path:
    """A served model (`preempt.model.random_llama.PRESETS`), written by the peer."""
    code = "import sys; from preempt.model.random_llama import write_random_llama as w; w(*sys.argv[1:])"
    subprocess.run([str(peer_python), "-c", code, str(model_dir), preset], check=True, env=server_env())
    return model_dir


# --------------------------------------------------------------------- summary
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

        counters: dict[str, float] = {}
        for run in runs:
            for key, value in run["metrics"].items():
                counters[key] = counters.get(key, 0.0) + value
        pairs = [(a, b) for run, ref in zip(runs, reference["runs"], strict=True)
                 for a, b in zip(run["requests"], ref["requests"], strict=True)]  # fmt: skip
        same = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
        row = {
            "ttft_top_s": over_seeds(lambda run: run["ttft_s"][top]),
            "ttft_top_s_per_seed": [round(run["ttft_s"][top], 3) for run in runs],
            "ttft_low_s": over_seeds(lambda run: run["ttft_s"][low]),
            "wall_s": over_seeds(lambda run: run["wall_s"]),
            # the counters these runs moved (one server serves every shape's runs)
            "preemptions": counters.get("vllm:num_preemptions_total"),
            "plugin_metrics": {k: v for k, v in counters.items() if k.startswith("preempt:")},
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
