"""The HTTP server against live uvicorn instances on loopback: the official `openai` client,
bad input, disconnects, backpressure, auth, graceful shutdown, and the CLI's flags."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from preempt.cli import main as cli_main
from preempt.config import EngineConfig, build_config
from preempt.request import RequestState
from preempt.server import EngineLoop, PreemptServer, add_serve_arguments, config_from_args, create_app

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
def running_server(config: EngineConfig, **app_kwargs: Any) -> Iterator[LiveServer]:
    """uvicorn in a background thread on a free loopback port (bound here, so no race)."""
    app = create_app(config, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv_config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10)
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


# ------------------------------------------------------------------------------ OpenAI API
def test_openai_completion_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny-2l", prompt="Hello, world", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.model == "tiny-2l"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(b"Hello, world") and whole.usage.completion_tokens == 12

    chunks = list(
        client.completions.create(
            model="tiny-2l",
            prompt="Hello, world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # greedy: same bytes, same (incremental) decoding
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_openai_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model="tiny-2l", messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model="tiny-2l", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_sampling_and_sla_level_extension(client: openai.OpenAI) -> None:
    # temperature defaults to OpenAI's 1.0 (sampled, seeded per request); sla_level rides
    # in extra_body.
    out = client.completions.create(model="tiny-2l", prompt="abc", max_tokens=5, extra_body={"sla_level": 3})
    assert out.usage.completion_tokens == 5
    assert [m.id for m in client.models.list().data] == ["tiny-2l"]


def test_generate_whole_and_streamed(live: LiveServer) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 9, "sla_level": 1}
    whole = httpx.post(f"{live.url}/generate", json=body, headers=AUTH, timeout=30).json()
    assert whole["final_state"] == "FINISHED" and len(whole["token_ids"]) == 9
    assert whole["usage"]["prompt_tokens"] == len(body["prompt"]) and whole["ttft_s"] > 0
    with httpx.stream(
        "POST", f"{live.url}/generate", json={**body, "stream": True}, headers=AUTH, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "length"
    assert [t for e in events[:-1] for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in events[:-1]) == whole["text"]


# ------------------------------------------------------------------------------ bad input
BAD_REQUESTS = [
    ("/generate", b'{"prompt": "hi", ', 400),  # invalid JSON
    ("/generate", b"[1, 2]", 400),  # not an object
    ("/generate", b"", 400),  # no body
    ("/generate", {"max_tokens": 4}, 400),  # missing prompt
    ("/generate", {"prompt": "hi", "max_tokens": "4"}, 400),  # wrong type (strict)
    ("/generate", {"prompt": "hi", "stream": 1}, 400),
    ("/generate", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/generate", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/generate", {"prompt": "hi", "max_tokens": 100_000}, 400),  # above the limit
    ("/generate", {"prompt": "x" * 2100, "max_tokens": 1}, 400),  # longer than the context
    ("/generate", {"prompt": "", "max_tokens": 1}, 400),
    ("/generate", {"prompt": "hi", "temperature": -1.0}, 400),
    ("/generate", {"prompt": "hi", "sla_level": -1}, 400),
    ("/generate", {"prompt": "hi", "bogus": 1}, 400),
    ("/generate", {"prompt": "x" * 2_000_000}, 413),  # oversized body
    ("/v1/completions", {"prompt": "hi", "stop": ["\n"]}, 400),  # unsupported field
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400),
    ("/v1/completions", {"prompt": [1, 300]}, 400),  # not a byte token id
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 4},
        400,
    ),  # fmt: skip
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS)
def test_bad_input_is_a_clear_4xx(live: LiveServer, path: str, body: Any, status: int) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{live.url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_engine_unaffected_by_bad_input(live: LiveServer) -> None:
    for path, body, _ in BAD_REQUESTS[:8]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(f"{live.url}{path}", content=content, headers=AUTH, timeout=30)
    ok = httpx.post(
        f"{live.url}/generate", json={"prompt": "still", "max_tokens": 3}, headers=AUTH, timeout=30
    )
    assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 3
    assert httpx.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}
    free, total, free_slots, slots = live.resources()
    assert (free, free_slots) == (total, slots)


def test_chunked_oversized_body_is_413(live: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count bytes
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    response = httpx.post(f"{live.url}/generate", content=chunks(), headers=AUTH, timeout=30)
    assert response.status_code == 413


# ------------------------------------------------------------------------------ auth
def test_api_key_required_on_generation_routes(live: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{live.url}/generate", json=body, timeout=10).status_code == 401
    wrong = httpx.post(
        f"{live.url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=10
    )
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny-2l", prompt="hi", max_tokens=2
        )
    # Probes and scrapers stay open.
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{live.url}/metrics", timeout=10).status_code == 200


# ------------------------------------------------------------------------------ faults
@pytest.fixture(scope="module")
def one_seat() -> Iterator[LiveServer]:
    """One batch seat, priority by score, swap to host: a VIP displaces the runner."""
    config = serve_config(
        scheduler={"max_num_seqs": 1, "policy": "priority_score"},
        preemption=SMALL_SLICES,
    )
    with running_server(config, max_queue=2) as server:
        yield server


def _open_stream(url: str, body: dict[str, Any]) -> tuple[contextlib.ExitStack, Iterator[Any]]:
    stack = contextlib.ExitStack()
    client = stack.enter_context(httpx.Client(timeout=30))
    response = stack.enter_context(client.stream("POST", f"{url}/generate", json={**body, "stream": True}))
    assert response.status_code == 200
    return stack, sse_events(response)


def test_disconnect_mid_stream_frees_blocks_and_host_slot(one_seat: LiveServer) -> None:
    url = one_seat.url
    low_stack, low_events = _open_stream(url, {"prompt": "background " * 8, "max_tokens": 1500})
    next(low_events)  # running
    vip_stack, vip_events = _open_stream(url, {"prompt": "vip", "max_tokens": 1500, "sla_level": 5})
    # The VIP displaced the background request, whose KV went to a host slot.
    assert wait_for(lambda: "host" in one_seat.on_engine(waiting_kv_locations)), "no swap happened"
    next(vip_events)

    low_stack.close()  # client gone while its KV sits in the host pool
    assert wait_for(lambda: one_seat.resources()[2] == one_seat.resources()[3]), "host slot not freed"
    vip_stack.close()  # client gone while running
    free, total, free_slots, slots = wait_for(lambda: (r := one_seat.resources())[0] == r[1] and r)
    assert (free, free_slots) == (total, slots)
    assert one_seat.on_engine(lambda e: e.scheduler.has_unfinished) is False
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'preempt_requests_total{final_state="ABORTED"} 2.0' in metrics


def test_disconnect_while_waiting_for_a_whole_answer_aborts(one_seat: LiveServer) -> None:
    body = json.dumps({"model": "tiny-2l", "prompt": "long", "max_tokens": 1500}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", int(one_seat.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(head + body)
        assert wait_for(lambda: one_seat.on_engine(lambda e: len(e.scheduler.running)) == 1)
    # The client is gone before any answer: the request must not run its 1500 tokens.
    assert wait_for(lambda: not one_seat.on_engine(lambda e: e.scheduler.has_unfinished), timeout=5)
    free, total, _, _ = one_seat.resources()
    assert free == total


def test_full_queue_answers_503_with_retry_after(one_seat: LiveServer) -> None:
    url = one_seat.url
    # The runner outranks the queued requests: they stay queued.
    runner_stack, runner_events = _open_stream(url, {"prompt": "runner", "max_tokens": 1500, "sla_level": 5})
    next(runner_events)
    queued = [_open_stream(url, {"prompt": f"queued {i}", "max_tokens": 2}) for i in range(2)]

    def refused() -> httpx.Response | None:
        r = httpx.post(f"{url}/generate", json={"prompt": "one more", "max_tokens": 2}, timeout=30)
        return r if r.status_code == 503 else None

    response = wait_for(refused, timeout=10)
    assert response is not None, "a full queue must refuse new requests"
    assert int(response.headers["retry-after"]) >= 1 and response.json()["error"]["code"] == "queue_full"
    runner_stack.close()
    for stack, events in queued:  # admitted once the runner is gone
        assert [e for e in events][-2]["final_state"] == "FINISHED"
        stack.close()
    assert (
        httpx.post(f"{url}/generate", json={"prompt": "ok", "max_tokens": 2}, timeout=30).status_code == 200
    )


def test_backoff_429_then_graceful_shutdown_frees_everything() -> None:
    # Slots of 1 KB cannot hold any request's KV: the VIP's preemption attempt fails, the
    # victim runs on (PREEMPTION_FAILED) and new admissions back off for 30 s.
    config = serve_config(
        scheduler={"max_num_seqs": 1, "policy": "priority_score"},
        preemption={
            **SMALL_SLICES,
            "host_mem": "64KB",
            "slot_size": "1KB",
            "backoff": {"base_s": 30.0, "cap_s": 30.0},
        },
    )
    with running_server(config) as live, ThreadPoolExecutor(1) as pool:
        url = live.url
        stack, events = _open_stream(url, {"prompt": "victim " * 4, "max_tokens": 2000})
        next(events)
        vip = pool.submit(
            httpx.post, f"{url}/generate", json={"prompt": "vip", "max_tokens": 4, "sla_level": 5}, timeout=60
        )
        # Ask for more only once the failure is in: a request admitted before it would
        # be held by the 30 s backoff.
        assert wait_for(lambda: live.on_engine(lambda e: e.scheduler.num_preemption_failed) == 1)

        def refused() -> httpx.Response | None:
            r = httpx.post(f"{url}/generate", json={"prompt": "late", "max_tokens": 2}, timeout=30)
            return r if r.status_code == 429 else None

        response = wait_for(refused, timeout=10)
        assert response is not None, "backoff must refuse new requests"
        # Retry-After is the backoff still left (rounded up), not a constant: the 30 s
        # backoff began at the failure, a few seconds ago at most.
        retry_after = int(response.headers["retry-after"])
        left = live.on_engine(lambda e: e.scheduler.backoff_until_s - e.clock.now())
        assert 20 < left <= retry_after <= left + 2
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'preempt_preemption_failures_total{reason="slot_too_small"} 1.0' in metrics

        # SIGTERM path: in-flight requests are aborted at once, then uvicorn stops.
        live.server.handle_exit(signal.SIGTERM, None)
        tail = list(events)
        assert tail[-1] == "[DONE]" and tail[-2]["error"]["code"] == "server_shutdown"
        assert vip.result(timeout=30).status_code == 503
        stack.close()
        live.thread.join(30)
        assert not live.thread.is_alive()
        engine_thread = live.engine_loop._thread
        assert engine_thread is not None and not engine_thread.is_alive()
        engine = live.engine_loop.engine  # the engine thread is gone: safe to read here
        assert engine.block_pool.num_free == engine.block_pool.num_blocks
        assert engine.saver.host_pool.num_used_slots == 0
        assert not engine.scheduler.has_unfinished
        states = {r.state for r in engine.scheduler.waiting_requests()}
        assert states <= {RequestState.ABORTED}


# ------------------------------------------------------------------------------ command line
def test_bad_size_flag_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "preempt.cli", "serve", "--preemption-host-mem", "bogus"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--preemption-host-mem" in result.stderr


def test_config_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from preempt.server import main as server_main

    assert server_main(["--preemption-host-mem", "1MB", "--preemption-slot-size", "2MB"]) == 2
    assert cli_main(["serve", "--model", "no-such-model"]) == 2
    virtual = tmp_path / "virtual.json"
    virtual.write_text('{"clock": {"kind": "virtual"}}')
    assert cli_main(["serve", "--config", str(virtual)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert "preemption" in err[0] and "--model" in err[1] and "clock.kind" in err[2]


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "serve.yaml"
    path.write_text("preemption:\n  host_mem: 1GB\n  slot_size: 64MB\n  max_preemption_per_min: 5\n")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--config", str(path), "--preemption-host-mem", "2GiB", "--set", "scheduler.max_num_seqs=3"]
    )
    config = config_from_args(args)
    assert config.preemption.host_mem == 2 * 2**30 and config.preemption.slot_size == 64 * 10**6
    assert config.preemption.max_preemption_per_min == 5 and config.scheduler.max_num_seqs == 3
    assert config.clock.kind == "wall" and config.model.preset == "tiny-2l"


def test_serve_config_json_is_the_specs_example() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(["--config", str(REPO / "serve_config.json")]))
    p = config.preemption
    assert p.time_slice_strategy == "dynamic" and p.min_time_slice_ms == 10
    assert (p.priority_weights.age, p.priority_weights.sla, p.priority_weights.tokens) == (1.2, 0.8, 0.5)
    assert p.max_preemption_per_min == 30
