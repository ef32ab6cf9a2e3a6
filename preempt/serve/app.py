"""The FastAPI app of `preempt serve`: routes, auth, errors, limits, and the OpenAPI document.

Owns: `create_app` (one engine loop, tokenizer, chat format and metrics registry per
app, never module-level state), bearer-token auth (constant-time compare), every error
in OpenAI's shape (validation, malformed JSON, 404, 405, 413, timeouts), the body-size
limit and body read timeout (`BodyLimit`), and an OpenAPI document that states what the
server really sends (400 with `ErrorResponse`, never FastAPI's 422; `/metrics` as text).

It must never touch the engine: handlers go through the `EngineLoop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preempt.core.config import EngineConfig
from preempt.model.tokenizer import ByteTokenizer
from preempt.obs.metrics import CONTENT_TYPE, PreemptionMetrics
from preempt.serve.chat import chat_format_for, eos_token_ids
from preempt.serve.engine_loop import DEFAULT_MAX_QUEUE, EngineLoop
from preempt.serve.handlers import Handlers
from preempt.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    error_response,
    http_error,
    validation_message,
)
from preempt.serve.weights import weights_line

logger = logging.getLogger("preempt.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0

_ERRORS = {  # what the generation routes may answer besides 200, as the OpenAPI document says
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "Invalid request (validation, malformed JSON, context or KV capacity exceeded)"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (408, "The request body did not arrive in time"),
        (413, "Request body too large"),
        (429, "Admissions are backing off after preemption failures (Retry-After)"),
        (500, "The request was aborted by an engine error"),
        (503, "Queue full or shutting down (Retry-After)"),
    )
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


class MetricsResponse(PlainTextResponse):
    """Prometheus' text format (so the OpenAPI document says text, not JSON)."""

    media_type = CONTENT_TYPE


class BodyLimit:
    """ASGI middleware: refuse bodies over `max_bytes` with 413 before any parsing
    (announced by Content-Length or streamed in chunks), and bodies that stop arriving
    for `timeout_s` with 408 (a client sending half a body is not held forever)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

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
                await error_response(APIError(400, "invalid Content-Length header"))(scope, receive, send)
                return
            if announced > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s  # the whole body, not per chunk
        while True:  # buffer the whole (bounded) body, then replay it to the app
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                err = APIError(
                    408, f"request body not received within {self.timeout_s:g} s", code="body_timeout"
                )
                await error_response(err)(scope, receive, send)
                return
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
        await error_response(err)(scope, receive, send)


def tokenizer_for(config: EngineConfig) -> Any:
    """The text <-> ids mapping of the served model: bytes for `tiny`/`null`, the
    checkpoint's own tokenizer for `hf`."""
    if config.model.backend == "hf":
        from preempt.model.hf import load_hf_tokenizer

        return load_hf_tokenizer(config.model.checkpoint)
    return ByteTokenizer()


def create_app(
    engine_config: EngineConfig,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    strict_fields: bool = False,
    metrics: PreemptionMetrics | None = None,
) -> FastAPI:
    """A new app with its own engine (built at startup), engine thread and registry.

    `app.state.engine_loop` is the EngineLoop (its engine exists once the app started).
    `api_key`: when set, generation routes need `Authorization: Bearer <api_key>`;
    `/health` and `/metrics` stay open (probes and scrapers carry no secrets).
    `strict_fields`: refuse unknown fields of OpenAI bodies (400) instead of logging them.
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
        logger.log(*weights_line(engine_config.model, engine_config.seed))
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="preempt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = engine_loop
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HTTPRequest, err: StarletteHTTPException) -> JSONResponse:
        return error_response(http_error(err.status_code, str(err.detail), dict(err.headers or {})))

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
    handlers = Handlers(
        engine_loop,
        tokenizer_for(engine_config),
        chat_format_for(engine_config),
        eos_token_ids(engine_config),
        strict_fields,
        engine_config.serve.default_max_tokens,
    )
    generation = {"dependencies": protected, "responses": {200: {"content": _SSE}, **_ERRORS}}

    @app.get("/health", responses={503: {"description": "The engine thread has stopped or failed"}})
    async def health() -> JSONResponse:
        if not engine_loop.is_alive:
            status = "error" if engine_loop.fatal_error else "stopped"
            return JSONResponse({"status": status, "error": engine_loop.fatal_error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=MetricsResponse)
    async def metrics_text() -> Response:
        return MetricsResponse(engine_loop.metrics.render())

    @app.get("/v1/models", dependencies=protected, responses={401: _ERRORS[401]})
    async def models() -> dict[str, Any]:
        name = engine_loop.facts.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "preempt"}]}

    @app.post("/generate", **generation)
    async def generate(body: GenerateRequest, request: HTTPRequest) -> Response:
        return await handlers.generate(body, request)

    @app.post("/v1/completions", **generation)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await handlers.completions(body, request)

    @app.post("/v1/chat/completions", **generation)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await handlers.chat(body, request)

    def openapi() -> dict[str, Any]:
        # FastAPI documents 422 for every route with a body; this server answers 400.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
