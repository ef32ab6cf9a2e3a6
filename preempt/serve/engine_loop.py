"""The engine thread of `preempt serve` and its bridge to asyncio.

Owns: `EngineLoop` (the engine and the one thread allowed to touch it), the command
queue (add, abort, finish, call) drained at step boundaries, admission control
(queue length, backoff, shutdown: `Rejected`), and the per-request `RequestStream`
whose `asyncio.Queue` receives token and end events.

It must never be touched from an HTTP handler except through `submit`, `abort`,
`finish` and `call`: the engine is not thread-safe. Events are snapshots (lists copied
on the engine thread), so handlers never read the engine's `Request` after submitting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from preempt.core.config import ConfigError, EngineConfig
from preempt.core.request import Request, RequestState
from preempt.engine.sampling import SamplingParams
from preempt.obs.latency import e2e_s, ttft_s
from preempt.obs.metrics import PreemptionMetrics

logger = logging.getLogger("preempt.server")

T = TypeVar("T")
DEFAULT_MAX_QUEUE = 256


class TokensEvent(NamedTuple):
    token_ids: list[int]
    logprobs: list[Any]  # preempt.engine.sampling.Sample per token, when the request asked for them


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
    finish_reason: str  # "stop" (a stop token or string) or "length"
    output_logprobs: list[Any]


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
        self.engine: Any = None  # preempt.engine.engine.Engine once started (imports torch)
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
        from preempt.engine.engine import Engine  # torch: only when a server really starts

        self.engine = Engine(self.config)
        try:
            self.metrics.bind_engine(self.engine)
            self.metrics.observe_step(self.engine)
            model = self.config.model
            name = model.preset if model.backend == "tiny" else model.backend
            self.facts = EngineFacts(
                name,
                model.max_model_len,
                self.engine.block_pool.num_blocks,
                self.engine.block_size,
                self.engine.runner.vocab_size,
            )
            self._thread = threading.Thread(target=self._run, name="preempt-engine", daemon=True)
            self._thread.start()
        except BaseException:
            # No engine thread will close it (that is where `_run` ends): free its host pool
            # now, which the metrics' callbacks would otherwise keep mapped.
            self.engine.close()
            raise

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
        self, prompt_token_ids: list[int], max_tokens: int, sampling: SamplingParams, sla_level: int
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
            temperature=sampling.temperature,
            sampling=None if sampling == SamplingParams(temperature=sampling.temperature) else sampling,
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

    def finish(self, stream: RequestStream) -> None:
        """End a request FINISHED now (the handler matched a stop string); no-op once it
        ended. Its blocks and host copy are freed like an abort's."""
        self._post(lambda: self._finish(stream.request.request_id))

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
                new_ids = request.output_token_ids[live.num_sent :]
                logprobs = request.output_logprobs[live.num_sent :] if request.output_logprobs else []
                outbox.append((live.stream, TokensEvent(new_ids, logprobs)))
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

    def _finish(self, request_id: int) -> None:
        live = self._live.pop(request_id, None)
        if live is None:  # already ended
            return
        request = live.stream.request
        self.engine.finish_request(request)
        self.metrics.observe_request_done(request)
        self.metrics.observe_step(self.engine)
        _emit(live.stream, _end_event(request, "stop"))

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


def _end_event(request: Request, finish_reason: str | None = None) -> EndEvent:
    return EndEvent(
        request.state.value,
        request.abort_reason,
        list(request.output_token_ids),
        request.num_prompt_tokens,
        request.num_preemptions,
        request.preemption_failed,
        ttft_s(request),
        e2e_s(request),
        finish_reason or ("stop" if request.stop_token_id is not None else "length"),
        list(request.output_logprobs),
    )
