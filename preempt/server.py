"""`preempt serve`: the engine behind HTTP (FastAPI + uvicorn), on the wall clock.

Owns: the app factory `create_app`, the engine thread (`EngineLoop`) and the bridge
between it and asyncio, request validation and limits, the wire formats (`/generate`,
OpenAI `/v1/completions` and `/v1/chat/completions` with server-sent events, `/metrics`,
`/health`), bearer-token auth, backpressure (429/503 with Retry-After), graceful
shutdown, and the `preempt serve` / `python -m preempt.server` flags.

It must never touch the engine from an HTTP handler: the engine is not thread-safe, so
every engine call runs on the engine thread, which drains a command queue (add, abort,
call) at step boundaries and pushes each request's tokens back to its handler's
`asyncio.Queue` with `loop.call_soon_threadsafe`. It keeps no module-level state: each
`create_app` builds its own engine, thread and metrics registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import uvicorn
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preempt.block_pool import blocks_needed
from preempt.cli import _Parser
from preempt.config import ConfigError, EngineConfig, apply_override, build_config, read_config_file
from preempt.metrics import CONTENT_TYPE, PreemptionMetrics
from preempt.model.tokenizer import ByteTokenizer
from preempt.request import Request, RequestState
from preempt.sizes import parse_size

logger = logging.getLogger("preempt.server")

T = TypeVar("T")
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SLA_LEVEL = 1000
_SSE_DONE = b"data: [DONE]\n\n"


# =============================================================================== engine side
class TokensEvent(NamedTuple):
    token_ids: list[int]


class EndEvent(NamedTuple):
    """A request's end, as a snapshot: handlers never read the engine's Request."""

    final_state: str  # RequestState value
    reason: str | None  # abort reason (client_disconnected, server_shutdown, engine_error, ...)
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_preemptions: int
    preemption_failed: bool
    ttft_s: float | None
    e2e_s: float | None


Event = TokensEvent | EndEvent


class Rejected(Exception):
    """A request refused before it reached the engine (backpressure, shutdown)."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class EngineFacts:
    """What handlers need to validate requests, fixed once the engine is built."""

    model_name: str
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int


@dataclass(eq=False)
class RequestStream:
    """One request's asyncio side. `request` belongs to the engine thread once submitted:
    handlers read only its immutable facts (id, prompt length)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    is_done: bool = False  # set by the handler when it has taken the EndEvent

    async def events(self) -> AsyncIterator[Event]:
        while not self.is_done:
            event = await self.queue.get()
            if isinstance(event, EndEvent):
                self.is_done = True
            yield event

    async def end(self) -> EndEvent:
        """Wait for the end, skipping tokens (a whole answer reads them from the end)."""
        while True:
            event = await self.queue.get()
            if isinstance(event, EndEvent):
                self.is_done = True
                return event


@dataclass
class _Live:
    stream: RequestStream
    num_sent: int = 0  # output tokens already pushed to the handler


class EngineLoop:
    """Owns the engine and the one thread allowed to touch it.

    The thread steps while requests are unfinished and sleeps on a condition when idle
    (or until the scheduler's admission backoff ends). Between steps it runs the queued
    commands, so a command waits at most one step. `submit` and `abort` are safe from any
    thread; `call(fn)` runs `fn(engine)` on the engine thread (inspection, tests).
    """

    def __init__(
        self,
        config: EngineConfig,
        metrics: PreemptionMetrics | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ) -> None:
        if config.clock.kind != "wall":
            raise ConfigError("the server runs on the wall clock: set clock.kind=wall")
        if max_queue <= 0:
            raise ValueError(f"max_queue must be > 0, got {max_queue}")
        self.config = config
        self.metrics = metrics if metrics is not None else PreemptionMetrics()
        self.max_queue = max_queue
        self.engine: Any = None  # preempt.engine.Engine once started (imports torch)
        self.facts: EngineFacts | None = None
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._live: dict[int, _Live] = {}  # engine thread only
        self._idle_until: float | None = None  # monotonic; set when a step could not run
        # Guarded by _cond: published by the engine thread for admission control.
        self._num_pending_adds = 0
        self._num_waiting = 0
        self._backoff_until = 0.0  # monotonic
        self._closing = False  # no new requests
        self._stopping = False  # the thread must exit
        self.fatal_error: str | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        from preempt.engine import Engine  # torch: only when a server really starts

        self.engine = Engine(self.config)
        self.metrics.bind_engine(self.engine)
        self.metrics.observe_step(self.engine)
        name = self.config.model.preset if self.config.model.backend == "tiny" else self.config.model.backend
        self.facts = EngineFacts(
            name,
            self.config.model.max_model_len,
            self.engine.block_pool.num_blocks,
            self.engine.block_size,
            self.engine.runner.vocab_size,
        )
        self._thread = threading.Thread(target=self._run, name="preempt-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    def begin_shutdown(self, reason: str = "server_shutdown") -> None:
        """Refuse new requests and abort every one in flight (their handlers answer at
        once), without waiting: called from a signal handler, before uvicorn waits for
        open connections to finish."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._commands.append(lambda: self._abort_all(reason))
            self._cond.notify()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the saver, join the engine thread. Idempotent."""
        self.begin_shutdown()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout_s)

    # ----------------------------------------------------------------- any thread
    def submit(
        self, prompt_token_ids: list[int], max_tokens: int, temperature: float, sla_level: int
    ) -> RequestStream:
        """Queue a request for the engine; raises Rejected under backpressure. Call from
        the event loop that will read the stream."""
        request = Request(
            request_id=next(self._ids),
            # WallClock.now() only reads perf_counter: safe off the engine thread, and it
            # puts arrival (the priority score's age, TTFT) at receipt, not at the drain.
            arrival_s=self.engine.clock.now(),
            prompt_token_ids=np.asarray(prompt_token_ids, dtype=np.int32),
            max_tokens=max_tokens,
            target_output_tokens=max_tokens,  # no EOS in the byte model: max_tokens is the length
            sla_level=sla_level,
            temperature=temperature,
        )
        stream = RequestStream(request, asyncio.get_running_loop())
        with self._cond:
            if self._closing or self.fatal_error is not None:
                raise Rejected(503, "shutting_down", "the server is shutting down")
            if self._num_pending_adds + self._num_waiting >= self.max_queue:
                raise Rejected(
                    503, "queue_full", f"too many queued requests (max_queue={self.max_queue})", 1.0
                )
            backoff_s = self._backoff_until - time.monotonic()
            if backoff_s > 0:
                raise Rejected(
                    429,
                    "backoff",
                    "admissions are backing off after preemption failures; retry later",
                    backoff_s,
                )
            self._num_pending_adds += 1
            self._commands.append(lambda: self._add(stream))
            self._cond.notify()
        return stream

    def abort(self, stream: RequestStream, reason: str = "client_disconnected") -> None:
        """Abort a request (no-op once it ended): frees its blocks and host slot."""
        self._post(lambda: self._abort(stream.request.request_id, reason))

    def call(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps; returns its future."""
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)

        if not self._post(run):
            future.set_exception(RuntimeError("the engine thread has stopped"))
        return future

    def _post(self, command: Callable[[], None]) -> bool:
        with self._cond:
            if self._thread is None or not self._thread.is_alive() or self._stopping:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                for command in self._wait_for_work():
                    command()
                if self._stopping:
                    break
                if engine.scheduler.has_unfinished:
                    self._step()
                self._publish()
        except Exception as err:  # noqa: BLE001 - reported to every in-flight request
            logger.exception("engine thread failed")
            with self._cond:
                self.fatal_error = f"{type(err).__name__}: {err}"
                self._closing = True
        finally:
            with self._cond:  # from here on nothing new is accepted
                self._closing = self._stopping = True
                leftover, self._commands = self._commands, []
            # Commands that raced the stop still run (an add is then aborted below, so no
            # handler waits forever); a broken engine must still free what it can.
            for command in leftover:
                with contextlib.suppress(Exception):
                    command()
            with contextlib.suppress(Exception):
                self._abort_all("engine_error" if self.fatal_error else "server_shutdown")
            engine.close()

    def _wait_for_work(self) -> list[Callable[[], None]]:
        with self._cond:
            while not self._commands and not self._stopping:
                if not self.engine.scheduler.has_unfinished:
                    self._cond.wait()
                    continue
                if self._idle_until is None:
                    break
                remaining = self._idle_until - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._idle_until = None
            commands, self._commands = self._commands, []
            return commands

    def _step(self) -> None:
        engine = self.engine
        output = engine.step()
        # Metrics first: a client that sees its response can already scrape them.
        self.metrics.observe_step(engine, output)
        if not output.scheduled.chunks and not output.scheduled.preempted:
            # Nothing could run: the admission backoff holds new requests. Sleep until it
            # ends (commands still wake us) instead of spinning.
            backoff_s = engine.scheduler.backoff_until_s - engine.clock.now()
            self._idle_until = time.monotonic() + (backoff_s if backoff_s > 0 else 0.005)
        outbox: list[tuple[RequestStream, Event]] = []
        for chunk in output.scheduled.chunks:
            request = chunk.request
            live = self._live.get(request.request_id)
            if live is not None and request.num_output_tokens > live.num_sent:
                outbox.append((live.stream, TokensEvent(request.output_token_ids[live.num_sent :])))
                live.num_sent = request.num_output_tokens
        for request in output.finished:
            live = self._live.pop(request.request_id, None)
            self.metrics.observe_request_done(request)
            if live is not None:
                outbox.append((live.stream, _end_event(request)))
        _emit_all(outbox)

    def _publish(self) -> None:
        scheduler = self.engine.scheduler
        backoff_s = scheduler.backoff_until_s - self.engine.clock.now()
        with self._cond:
            self._num_waiting = scheduler.num_waiting
            self._backoff_until = time.monotonic() + backoff_s

    def _add(self, stream: RequestStream) -> None:
        request = stream.request
        self.engine.add_request(request)
        with self._cond:  # both at once: the queue length seen by `submit` never dips
            self._num_pending_adds -= 1
            self._num_waiting = self.engine.scheduler.num_waiting
        if request.state is RequestState.ABORTED:  # can never run (context, KV capacity)
            self.metrics.observe_request_done(request)
            _emit(stream, _end_event(request))
        else:
            self._live[request.request_id] = _Live(stream)

    def _abort(self, request_id: int, reason: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:  # already ended
            return
        request = live.stream.request
        self.engine.abort_request(request, reason)
        self.metrics.observe_request_done(request)
        self.metrics.observe_step(self.engine)
        _emit(live.stream, _end_event(request))

    def _abort_all(self, reason: str) -> None:
        for request_id in list(self._live):
            self._abort(request_id, reason)


def _emit(stream: RequestStream, event: Event) -> None:
    _emit_all([(stream, event)])


def _emit_all(outbox: list[tuple[RequestStream, Event]]) -> None:
    """Hand a step's events to their event loops: one wake-up per loop per step, not one
    per request (each `call_soon_threadsafe` writes the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Event]]] = {}
    for stream, event in outbox:
        by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _deliver(events: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in events:
        stream.queue.put_nowait(event)


def _end_event(request: Request) -> EndEvent:
    ttft = None if request.first_token_s is None else request.first_token_s - request.arrival_s
    e2e = None if request.finish_s is None else request.finish_s - request.arrival_s
    return EndEvent(
        request.state.value,
        request.abort_reason,
        list(request.output_token_ids),
        request.num_prompt_tokens,
        request.num_preemptions,
        request.preemption_failed,
        ttft,
        e2e,
    )


# =============================================================================== wire formats
class _Body(BaseModel):
    # strict: "10" is not a number and 1 is not a bool; extra: a field we would silently
    # ignore (stop, logprobs, ...) is refused instead.
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateRequest(_Body):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    sla_level: int = Field(0, ge=0, le=MAX_SLA_LEVEL)
    """Service class, higher = more important (the priority score's SLA term)."""
    stream: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """None: OpenAI's default, 1.0 (sampled)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    top_p: float | None = None
    user: str | None = None
    sla_level: int = Field(0, ge=0, le=MAX_SLA_LEVEL)
    """Extension (pass with the client's `extra_body`): the request's service class."""

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, top_p: float | None) -> float | None:
        if top_p not in (None, 1.0):
            raise ValueError("only top_p=1 is supported")
        return top_p


class CompletionRequest(_OpenAIBody):
    prompt: str | list[int]
    """Text, or byte-level token ids (0..255)."""


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class ChatCompletionRequest(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_length(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self


def render_chat(messages: list[ChatMessage]) -> str:
    """The byte model has no chat template of its own: one tagged block per message, then
    the assistant's tag to continue from."""
    parts = []
    for message in messages:
        content = message.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        parts.append(f"<|{message.role}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
        self.headers = headers or {}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body, status_code=err.status, headers=err.headers)


def _rejected_error(err: Rejected) -> APIError:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    kind = "rate_limit_error" if err.status == 429 else "service_unavailable"
    return APIError(err.status, str(err), error_type=kind, code=err.code, headers=headers)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return f"invalid JSON body: {detail}", None
    if kind == "extra_forbidden":
        return f"unknown or unsupported field '{param}'", param
    if kind == "missing":
        return (f"missing field '{param}'", param) if param else ("missing JSON request body", None)
    if not param and kind in ("model_attributes_type", "dict_type"):
        return "request body must be a JSON object (Content-Type: application/json)", None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else f"request body: {message}"), param


def _end_error(end: EndEvent) -> APIError:
    """The error for a request that ended ABORTED."""
    reason = end.reason or "aborted"
    if reason.startswith(("prompt_too_long", "exceeds_kv_capacity")):
        return APIError(400, reason, param="max_tokens", code=reason.split(":")[0])
    if reason == "server_shutdown":
        return APIError(503, "the server is shutting down", error_type="service_unavailable", code=reason)
    return APIError(500, f"request aborted: {reason}", error_type="server_error", code="aborted")


def _usage(end: EndEvent) -> dict[str, int]:
    num_out = len(end.output_token_ids)
    return {
        "prompt_tokens": end.num_prompt_tokens,
        "completion_tokens": num_out,
        "total_tokens": end.num_prompt_tokens + num_out,
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _EngineStreamResponse(StreamingResponse):
    """A streaming response that aborts its request however the response ends: client
    gone (Starlette cancels the stream), a failed send, or a body never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _BodyLimit:
    """ASGI middleware: refuse bodies over `max_bytes` with 413, before any parsing,
    whether announced by Content-Length or streamed in chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            try:
                announced = int(length)
            except ValueError:
                await _error_response(APIError(400, "invalid Content-Length header"))(scope, receive, send)
                return
            if announced > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:  # buffer the whole (bounded) body, then replay it to the app
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(413, f"request body larger than {self.max_bytes} bytes", code="body_too_large")
        await _error_response(err)(scope, receive, send)


# =============================================================================== the app
def create_app(
    engine_config: EngineConfig,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: PreemptionMetrics | None = None,
) -> FastAPI:
    """A new app with its own engine (built at startup), engine thread and registry.

    `app.state.engine_loop` is the EngineLoop (its engine exists once the app started).
    `api_key`: when set, generation routes need `Authorization: Bearer <api_key>`;
    `/health` and `/metrics` stay open (probes and scrapers carry no secrets).
    """
    engine_loop = EngineLoop(engine_config, metrics, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        facts = engine_loop.facts
        logger.info(
            "engine ready: model %s, %d KV blocks of %d tokens, preemption mode %s",
            facts.model_name,
            facts.num_blocks,
            facts.block_size,
            engine_config.preemption.mode,
        )
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="preempt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = engine_loop
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return _error_response(APIError(400, message, param=param))

    async def authorize(request: HTTPRequest) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                error_type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    protected = [Depends(authorize)]
    handlers = _Handlers(engine_loop, _tokenizer_for(engine_loop.config))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine_loop.is_alive:
            status = "error" if engine_loop.fatal_error else "stopped"
            return JSONResponse({"status": status, "error": engine_loop.fatal_error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(engine_loop.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict[str, Any]:
        name = engine_loop.facts.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "preempt"}]}

    @app.post("/generate", dependencies=protected)
    async def generate(body: GenerateRequest, request: HTTPRequest) -> Response:
        return await handlers.generate(body, request)

    @app.post("/v1/completions", dependencies=protected)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await handlers.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await handlers.chat(body, request)

    return app


def _tokenizer_for(config: EngineConfig) -> Any:
    """The text <-> ids mapping of the served model: bytes for `tiny`/`null`, the
    checkpoint's own tokenizer for `hf`."""
    if config.model.backend == "hf":
        from preempt.model.hf import load_hf_tokenizer

        return load_hf_tokenizer(config.model.checkpoint)
    return ByteTokenizer()


class _Handlers:
    """The generation routes: validate, submit, then answer whole or as events."""

    def __init__(self, engine_loop: EngineLoop, tokenizer: Any) -> None:
        self.loop = engine_loop
        # ByteTokenizer for `tiny`; a checkpoint's tokenizer.json for `hf` (load_hf_tokenizer)
        self.tokenizer = tokenizer

    # ----------------------------------------------------------------- routes
    async def generate(self, body: GenerateRequest, http: HTTPRequest) -> Response:
        stream = self._submit(
            self.tokenizer.encode(body.prompt), body.max_tokens, body.temperature, body.sla_level
        )
        rid = f"gen-{stream.request.request_id}"
        if body.stream:
            return self._sse_response(stream, self._generate_events(stream, rid))
        end = await self._until_end(stream, http)
        if end is None:
            return Response(status_code=499)  # client closed the request: nobody reads this
        if end.final_state == RequestState.ABORTED.value:
            return _error_response(_end_error(end))
        return JSONResponse(
            {
                "id": rid,
                "text": self.tokenizer.decode(end.output_token_ids),
                "token_ids": end.output_token_ids,
                "finish_reason": "length",
                "final_state": end.final_state,
                "num_preemptions": end.num_preemptions,
                "preemption_failed": end.preemption_failed,
                "ttft_s": end.ttft_s,
                "e2e_s": end.e2e_s,
                "usage": _usage(end),
            }
        )

    async def completions(self, body: CompletionRequest, http: HTTPRequest) -> Response:
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode(body.prompt)
        else:
            vocab_size = self.loop.facts.vocab_size
            if any(not 0 <= t < vocab_size for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
            prompt_ids = list(body.prompt)
        stream = self._submit(prompt_ids, *self._sampling(body, body.max_tokens))
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.loop.facts.model_name,
        }
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return self._sse_response(stream, self._openai_events(stream, head, False, include_usage))
        end = await self._until_end(stream, http)
        if end is None:
            return Response(status_code=499)  # client closed the request: nobody reads this
        if end.final_state == RequestState.ABORTED.value:
            return _error_response(_end_error(end))
        choice = {
            "index": 0,
            "text": self.tokenizer.decode(end.output_token_ids),
            "logprobs": None,
            "finish_reason": "length",
        }
        return JSONResponse({**head, "choices": [choice], "usage": _usage(end)})

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        self._check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        stream = self._submit(
            self.tokenizer.encode(render_chat(body.messages)), *self._sampling(body, max_tokens)
        )
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.loop.facts.model_name,
        }
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            head = {**head, "object": "chat.completion.chunk"}
            return self._sse_response(stream, self._openai_events(stream, head, True, include_usage))
        end = await self._until_end(stream, http)
        if end is None:
            return Response(status_code=499)  # client closed the request: nobody reads this
        if end.final_state == RequestState.ABORTED.value:
            return _error_response(_end_error(end))
        message = {"role": "assistant", "content": self.tokenizer.decode(end.output_token_ids)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        return JSONResponse({**head, "choices": [choice], "usage": _usage(end)})

    # ----------------------------------------------------------------- helpers
    def _check_model(self, model: str | None) -> None:
        name = self.loop.facts.model_name
        if model is not None and model != name:
            raise APIError(
                404,
                f"model '{model}' not found; this server serves '{name}'",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _sampling(body: _OpenAIBody, max_tokens: int | None) -> tuple[int, float, int]:
        temperature = 1.0 if body.temperature is None else body.temperature
        return (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens), temperature, body.sla_level

    def _submit(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, sla_level: int
    ) -> RequestStream:
        facts = self.loop.facts
        if not prompt_ids:
            raise APIError(400, "prompt is empty", param="prompt")
        if max_tokens >= facts.max_model_len:
            raise APIError(
                400,
                f"max_tokens={max_tokens} is above the limit: the context holds {facts.max_model_len} "
                "tokens, prompt included",
                param="max_tokens",
            )
        total = len(prompt_ids) + max_tokens
        if total > facts.max_model_len:
            raise APIError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"context of {facts.max_model_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if blocks_needed(total, facts.block_size) > facts.num_blocks:
            raise APIError(
                400,
                f"prompt + max_tokens = {total} tokens exceeds the KV cache "
                f"({facts.num_blocks} blocks of {facts.block_size} tokens)",
                param="max_tokens",
                code="exceeds_kv_capacity",
            )
        try:
            return self.loop.submit(prompt_ids, max_tokens, temperature, sla_level)
        except Rejected as err:
            self.loop.metrics.observe_rejected(err.code)
            raise _rejected_error(err) from None

    async def _until_end(self, stream: RequestStream, http: HTTPRequest) -> EndEvent | None:
        """Wait for the request's end; if the client goes away first, abort it (None)."""
        end_task = asyncio.ensure_future(stream.end())
        gone_task = asyncio.ensure_future(_client_gone(http))
        try:
            await asyncio.wait({end_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler itself is cancelled
            gone_task.cancel()
            is_gone = not end_task.done()
            if is_gone:
                end_task.cancel()
                self.loop.abort(stream)
        return None if is_gone else end_task.result()

    def _sse_response(self, stream: RequestStream, body: AsyncIterator[bytes]) -> Response:
        def on_close() -> None:
            if not stream.is_done:
                self.loop.abort(stream)

        return _EngineStreamResponse(body, on_close)

    async def _generate_events(self, stream: RequestStream, rid: str) -> AsyncIterator[bytes]:
        decoder = self.tokenizer.stream_decoder()
        async for event in stream.events():
            if isinstance(event, TokensEvent):
                text = decoder.push(event.token_ids)
                yield _sse({"id": rid, "text": text, "token_ids": event.token_ids})
            elif event.final_state == RequestState.ABORTED.value:
                yield _sse(_end_error(event).body)
            else:
                yield _sse(
                    {
                        "id": rid,
                        "text": decoder.flush(),
                        "token_ids": [],
                        "finish_reason": "length",
                        "final_state": event.final_state,
                        "num_preemptions": event.num_preemptions,
                        "preemption_failed": event.preemption_failed,
                        "ttft_s": event.ttft_s,
                        "e2e_s": event.e2e_s,
                        "usage": _usage(event),
                    }
                )
        yield _SSE_DONE

    async def _openai_events(
        self, stream: RequestStream, head: dict[str, Any], is_chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        # A token may end mid-character: the stream decoder holds it until the character
        # completes, so the streamed text concatenates to the whole text.
        decoder = self.tokenizer.stream_decoder()

        def chunk(text: str, finish_reason: str | None, first: bool = False) -> bytes:
            if is_chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            payload = {**head, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        if is_chat:
            yield chunk("", None, first=True)
        async for event in stream.events():
            if isinstance(event, TokensEvent):
                text = decoder.push(event.token_ids)
                if text:
                    yield chunk(text, None)
            elif event.final_state == RequestState.ABORTED.value:
                yield _sse(_end_error(event).body)
            else:
                yield chunk(decoder.flush(), "length")
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(event)})
        yield _SSE_DONE


async def _client_gone(http: HTTPRequest) -> None:
    """Returns when the client disconnects (the body is already read, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


# =============================================================================== command line
class PreemptServer(uvicorn.Server):
    """uvicorn, plus: on SIGINT/SIGTERM abort in-flight requests *before* uvicorn waits
    for open connections, so long streams end now (their clients get an error event)
    instead of holding the shutdown for minutes."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.begin_shutdown()
        super().handle_exit(sig, frame)


def _size_arg(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `preempt serve` and `python -m preempt.server`."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--config",
        type=Path,
        help="JSON or YAML engine config, e.g. serve_config.json (may hold only `preemption`)",
    )
    parser.add_argument(
        "--preemption-host-mem",
        type=_size_arg,
        help="host memory for saved KV, e.g. 4GB, 512MiB (preemption.host_mem; default 4GB)",
    )
    parser.add_argument(
        "--preemption-slot-size",
        type=_size_arg,
        help="one request's saved-KV slot, e.g. 256MB (preemption.slot_size; default 256MB)",
    )
    parser.add_argument("--model", help="tiny model preset (model.preset; default tiny-2l)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer <key>` on generation routes")
    parser.add_argument(
        "--max-queue",
        type=_positive_int,
        default=DEFAULT_MAX_QUEUE,
        help=f"queued requests before new ones get 503 (default {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-body-size",
        type=_size_arg,
        default="1MiB",
        help="largest request body (default 1MiB; larger: 413)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set scheduler.max_num_seqs=16 (repeatable)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Config file < --set < dedicated flags; the clock is always the wall clock."""
    data = read_config_file(args.config) if args.config is not None else {}
    for assignment in args.set:
        apply_override(data, assignment)
    kind = (data.get("clock") or {}).get("kind", "wall")
    if kind != "wall":
        raise ConfigError(f"config key 'clock.kind': the server runs on the wall clock, got '{kind}'")
    flags = {
        "clock.kind": "wall",
        "model.preset": args.model,
        "preemption.host_mem": args.preemption_host_mem,
        "preemption.slot_size": args.preemption_slot_size,
    }
    for key, value in flags.items():
        if value is not None:
            section, name = key.split(".")
            data.setdefault(section, {})[name] = value
    config = build_config(data)
    if config.model.backend == "tiny":
        from preempt.model.tiny import PRESETS

        if config.model.preset not in PRESETS:
            raise ConfigError(
                f"--model: unknown preset '{config.model.preset}'; choose one of {sorted(PRESETS)}"
            )
    return config


def serve(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
) -> None:
    """Run the server until SIGINT/SIGTERM (blocking)."""
    app = create_app(config, api_key=api_key, max_queue=max_queue, max_body_bytes=max_body_bytes)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=30
    )
    PreemptServer(uv_config, app.state.engine_loop).run()


def cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.preemption.mode == "recompute" and (args.preemption_host_mem or args.preemption_slot_size):
        print(
            "preempt serve: warning: preemption.mode is 'recompute' (nothing is saved to host "
            "memory): --preemption-host-mem/--preemption-slot-size apply to swap, swap_zstd and pause",
            file=sys.stderr,
        )
    serve(
        config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=parse_size(args.max_body_size),
        log_level=args.log_level,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="preempt serve", description="Serve the engine over HTTP (OpenAI-compatible).")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except ConfigError as err:
        print(f"preempt serve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
