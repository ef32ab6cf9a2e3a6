"""`preempt serve` / `python -m preempt.server`: flags, config, and running uvicorn.

Owns: the command line (every bad value is one line on stderr and exit 2, checked
before the engine loads), the config built from file < --set < flags, and the uvicorn
server: graceful SIGTERM (in-flight requests aborted first), a header read timeout and a
cap on open connections (`LimitedH11Protocol`), which uvicorn itself does not offer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from preempt.core.cli_args import ArgParser
from preempt.core.config import ConfigError, EngineConfig, build_config
from preempt.core.config_files import apply_override, read_config_file
from preempt.core.sizes import parse_size
from preempt.serve.app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, create_app
from preempt.serve.engine_loop import DEFAULT_MAX_QUEUE, EngineLoop
from preempt.serve.weights import default_to_reference_lm

logger = logging.getLogger("preempt.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024


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


def _raw_error(status: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def limited_h11(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header read timeout (a connection that has not sent a
    whole request head within `header_timeout_s`, first or next, is closed: slowloris)
    and a connection cap (connection `max_connections + 1` gets an OpenAI-shaped 503 and
    is closed, instead of uvicorn's plain-text one after it read the request)."""

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                message = f"too many open connections (max {max_connections})"
                transport.write(_raw_error("503 Service Unavailable", message, "too_many_connections"))
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's head must come in time too

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            in_flight = self.cycle is not None and not self.cycle.response_complete
            if not in_flight and not self.transport.is_closing():
                self.transport.close()  # no request head in time: nothing to answer

    return LimitedH11Protocol


# ------------------------------------------------------------------------------ flags
def _size_arg(text: str) -> str:
    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `preempt serve` and `python -m preempt.server`."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
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
        help="largest saved-KV blob of one request, e.g. 256MB (preemption.slot_size; default 256MB); "
        "each blob takes only its own size in the pool",
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
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections at once; more get 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--header-timeout",
        type=_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help=f"seconds for a request's head to arrive, else the connection closes "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=_seconds,
        default=DEFAULT_BODY_TIMEOUT_S,
        help=f"seconds for a request's whole body to arrive, else 408 (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse unknown fields in OpenAI requests (400) instead of ignoring them with a warning",
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
    """Config file < --set < dedicated flags; the clock is always the wall clock. A config
    that chooses no model (no model.backend, model.checkpoint, model.preset or --model)
    serves the reference LM that `make run` trains, when the working directory holds it."""
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
    default_to_reference_lm(data)
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
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    strict_fields: bool = False,
    log_level: str = "info",
) -> None:
    """Run the server until SIGINT/SIGTERM (blocking)."""
    app = create_app(
        config,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        strict_fields=strict_fields,
    )
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    PreemptServer(
        uvicorn_config(app, host, port, log_level, header_timeout_s, max_connections), app.state.engine_loop
    ).run()


def uvicorn_config(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    timeout_graceful_shutdown: int = 30,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        http=limited_h11(header_timeout_s, max_connections),
    )


def _check_bind(host: str, port: int) -> None:
    """Fail before the engine loads (seconds, maybe minutes) if the address is unusable."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError(f"--host: cannot resolve '{host}': {err}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {err.strerror}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.preemption.mode == "recompute" and (args.preemption_host_mem or args.preemption_slot_size):
        print(
            "preempt serve: warning: preemption.mode is 'recompute' (nothing is saved to host "
            "memory): --preemption-host-mem/--preemption-slot-size apply to swap, swap_zstd and pause",
            file=sys.stderr,
        )
    _check_bind(args.host, args.port)
    serve(
        config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=parse_size(args.max_body_size),
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        strict_fields=args.strict_fields,
        log_level=args.log_level,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgParser(prog="preempt serve", description="Serve the engine over HTTP (OpenAI-compatible).")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except ConfigError as err:
        print(f"preempt serve: error: {err}", file=sys.stderr)
        return 2
