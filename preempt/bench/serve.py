"""`preempt bench serve`: the HTTP server's overhead against the engine in-process.

The same small workload (N prompts, 64 output tokens each, all sent at once) runs through
`Engine.generate` in this process, then through `preempt serve` in a subprocess over
loopback, with whole answers and with server-sent-event streams. Reported as requests/s,
tokens/s, and time relative to in-process (the client shares the machine's cores).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

from preempt.config import build_config
from preempt.engine import Engine

NUM_OUTPUT_TOKENS = 64
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
    finally:
        server.terminate()
        server.wait(30)
    return result
