"""`preempt bench serve`: the HTTP server's overhead against the engine in-process.

The same small workload (N prompts, 64 output tokens each, all sent at once) runs through
`Engine.generate` in this process, then through `preempt serve` in a subprocess over
loopback, with whole answers and with server-sent-event streams. Reported as requests/s,
tokens/s, and time relative to in-process (the client shares the machine's cores).

Then, when the `load` extra (guidellm) is installed, guidellm sweeps constant request
rates against the same server (streamed /v1/completions, a byte-level tokenizer file
matching the server's), and the engine replays guidellm's own prompts in-process at each
rate on the wall clock: throughput, TTFT and ITL percentiles of both, by the same code
(`preempt.bench.load.summarize`). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from preempt.bench.load import INSTALL_HINT, RequestTiming, guidellm_installed, run_guidellm, summarize
from preempt.core.config import build_config
from preempt.core.request import Request
from preempt.engine.engine import Engine

NUM_OUTPUT_TOKENS = 64
LOAD_PROMPT_TOKENS = 64
# (rates in requests/s, requests per rate); the all-at-once run above puts the server's
# streamed capacity near 100 req/s on 2 cores, so the top rate overloads it.
LOAD_SWEEP = {True: ((8.0, 32.0), 16), False: ((8.0, 32.0, 128.0), 64)}
SETTINGS = {
    "model": {"preset": "tiny-2l", "dtype": "float32", "max_model_len": 1024, "num_threads": 1},
    "cache": {"block_size": 16, "num_blocks": 512},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
    "clock": {"kind": "wall"},
}


def _prompts(num: int) -> list[str]:
    return [(f"request {i:03d} " * 4)[:32] for i in range(num)]


def _in_process(num: int) -> tuple[float, int]:
    engine = Engine(build_config(SETTINGS))
    engine.generate(["warm"], 4)
    started = time.perf_counter()
    outputs = engine.generate(_prompts(num), NUM_OUTPUT_TOKENS)
    elapsed = time.perf_counter() - started
    engine.close()
    return elapsed, sum(len(o) for o in outputs)


def _in_process_at_rate(engine: Engine, prompts: Sequence[str], rate: float) -> list[RequestTiming]:
    """The prompts arriving every 1/rate s on the engine's wall clock, sampled at
    temperature 1 (the server's default) for NUM_OUTPUT_TOKENS tokens each."""
    start_s = engine.clock.now()
    requests = [
        Request(
            request_id=index,
            arrival_s=start_s + index / rate,
            prompt_token_ids=np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).astype(np.int32),
            max_tokens=NUM_OUTPUT_TOKENS,
            target_output_tokens=NUM_OUTPUT_TOKENS,
            temperature=1.0,
        )
        for index, prompt in enumerate(prompts)
    ]
    engine.run(requests)
    return [RequestTiming(r.arrival_s, r.first_token_s, r.finish_s, r.num_output_tokens) for r in requests]


def _load_sweep(port: int, quick: bool) -> tuple[dict[str, Any], list[Any]]:
    """guidellm against the running server; its runs come back for the in-process side."""
    rates, num_requests = LOAD_SWEEP[quick]
    with tempfile.TemporaryDirectory(prefix="preempt-guidellm-") as workdir:
        runs = run_guidellm(
            f"http://127.0.0.1:{port}",
            Path(workdir),
            rates,
            num_requests,
            prompt_tokens=LOAD_PROMPT_TOKENS,
            output_tokens=NUM_OUTPUT_TOKENS,
        )
    for run in runs:
        # A tokenizer that does not match the server's would make every count below wrong.
        wrong = [n for n in run.num_prompt_tokens if n != LOAD_PROMPT_TOKENS]
        if wrong:
            raise RuntimeError(f"server counted {wrong[0]} prompt tokens, guidellm sent {LOAD_PROMPT_TOKENS}")
    header = {
        "generator": f"guidellm {version('guidellm')}",
        "endpoint": "/v1/completions (stream)",
        "prompt_tokens": LOAD_PROMPT_TOKENS,
        "output_tokens": NUM_OUTPUT_TOKENS,
        "requests_per_rate": num_requests,
    }
    return header, runs


def _compare(runs: list[Any]) -> list[dict[str, Any]]:
    engine = Engine(build_config(SETTINGS))
    engine.generate(["warm"], 4)
    rows = []
    for run in runs:
        served = summarize(run.timings)
        local = summarize(_in_process_at_rate(engine, run.prompts, run.rate))
        row: dict[str, Any] = {
            "rate": run.rate,
            "guidellm": {**served, "errored": run.num_errored, "incomplete": run.num_incomplete},
            "in_process": local,
        }
        if served.get("ttft_ms") and local.get("ttft_ms"):
            row["ttft_p50_vs_in_process"] = round(served["ttft_ms"]["p50"] / local["ttft_ms"]["p50"], 2)
            row["itl_p50_vs_in_process"] = round(served["itl_ms"]["p50"] / local["itl_ms"]["p50"], 2)
        rows.append(row)
    engine.close()
    return rows


async def _through_http(port: int, num: int, stream: bool) -> tuple[float, int]:
    import httpx

    limits = httpx.Limits(max_connections=num + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as client:
        await client.post("/generate", json={"prompt": "warm", "max_tokens": 4})

        async def one(prompt: str) -> int:
            body = {"prompt": prompt, "max_tokens": NUM_OUTPUT_TOKENS, "temperature": 0.0}
            if not stream:
                return len((await client.post("/generate", json=body)).json()["token_ids"])
            count = 0
            async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        count += len(json.loads(line[6:])["token_ids"])
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in _prompts(num)))
        return time.perf_counter() - started, sum(counts)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_serve(quick: bool = False) -> dict[str, Any]:
    import httpx

    num = 32 if quick else 128
    base_s, base_tokens = _in_process(num)
    result: dict[str, Any] = {
        "bench": "serve",
        "num_requests": num,
        "in_process": {"req_s": round(num / base_s, 1), "tok_s": round(base_tokens / base_s)},
    }
    port = _free_port()
    flags = [
        arg
        for section, values in SETTINGS.items()
        for key, value in values.items()
        for arg in ("--set", f"{section}.{key}={value}")
    ]
    server = subprocess.Popen(
        [sys.executable, "-m", "preempt.server", "--port", str(port), "--log-level", "warning", *flags]
    )
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        for name, stream in (("http_whole", False), ("http_stream", True)):
            elapsed, tokens = asyncio.run(_through_http(port, num, stream))
            assert tokens == base_tokens, (name, tokens, base_tokens)
            result[name] = {
                "req_s": round(num / elapsed, 1),
                "tok_s": round(tokens / elapsed),
                "time_vs_in_process": round(elapsed / base_s, 2),
            }
        load = _load_sweep(port, quick) if guidellm_installed() else None
    finally:
        server.terminate()
        server.wait(30)
    if load is None:
        result["load"] = {"skipped": f"guidellm is not installed ({INSTALL_HINT})"}
    else:
        header, runs = load
        # After the server stopped: the in-process side gets the cores to itself, as in
        # the all-at-once baseline.
        result["load"] = {**header, "sweep": _compare(runs)}
    return result
