"""Fixtures of the server tests: live uvicorn instances on loopback (bound here, so no port
race), each with its own engine, and helpers to read their engine state."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from preempt.core.config import EngineConfig, build_config
from preempt.serve import EngineLoop, PreemptServer, create_app
from preempt.serve.args import uvicorn_config

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Priority preemption on demand: any slice used, no rate cap.
SMALL_SLICES = {
    "min_time_slice_ms": 0.0,
    "time_slices": {"long_ms": 2.0, "medium_ms": 2.0, "short_ms": 2.0, "static_ms": 2.0},
    "max_preemption_per_min": None,
}


# ------------------------------------------------------------------------------ helpers
def serve_config(**sections: dict[str, Any]) -> EngineConfig:
    """tiny-2l in float64 (batching can never flip a greedy argmax), a small pool, one
    torch thread (the other core runs the save worker and the test), the wall clock."""
    data: dict[str, Any] = {
        "model": {"preset": "tiny-2l", "dtype": "float64", "max_model_len": 2048, "num_threads": 1},
        "cache": {"block_size": 16, "num_blocks": 160},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 256},
        "clock": {"kind": "wall"},
        "preemption": {"mode": "swap", "host_mem": "16MB", "slot_size": "4MB"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return build_config(data)


@dataclass
class LiveServer:
    url: str
    engine_loop: EngineLoop
    server: PreemptServer
    thread: threading.Thread

    def on_engine(self, fn: Callable[[Any], Any]) -> Any:
        return self.engine_loop.call(fn).result(timeout=10)

    def resources(self) -> tuple[int, int, int, int]:
        """(free blocks, total blocks, free host slots, total host slots), checked."""

        def read(engine: Any) -> tuple[int, int, int, int]:
            engine.block_pool.check()
            pool = engine.saver.host_pool
            pool.check()
            return (
                engine.block_pool.num_free,
                engine.block_pool.num_blocks,
                pool.num_free_slots,
                pool.num_slots,
            )

        return self.on_engine(read)


@contextlib.contextmanager
def running_server(
    config: EngineConfig, server_kwargs: dict[str, Any] | None = None, **app_kwargs: Any
) -> Iterator[LiveServer]:
    """uvicorn in a background thread on a free loopback port (bound here, so no race)."""
    app = create_app(config, **app_kwargs)
    server_kwargs = server_kwargs or {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv_config = uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=10, **server_kwargs)
    server = PreemptServer(uv_config, app.state.engine_loop)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=60)
        assert server.started, "server did not start"
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.engine_loop, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def sse_events(response: httpx.Response) -> Iterator[Any]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def waiting_kv_locations(engine: Any) -> list[Any]:
    return [r.kv_location for r in engine.scheduler.waiting_requests()]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with running_server(serve_config(), api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
