"""The wire formats of `preempt serve`: request bodies, errors, and their OpenAPI shapes.

Owns: the pydantic models of `/generate` (this project's own API: unknown fields are
refused) and of OpenAI's `/v1/completions` and `/v1/chat/completions` (unknown fields are
accepted and logged, as vLLM does, unless the server runs with `strict_fields`), the
`APIError` in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and the
translation of validation failures into one clear message naming the field.

It must never talk to the engine: everything here is pure data checking.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_SLA_LEVEL = 1000
MAX_N = 16  # choices per request: each one is a request in the engine
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _valid_unicode(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"), which no UTF-8 tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid Unicode text ({err.reason} at character {err.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    # strict: "10" is not a number and 1 is not a bool.
    model_config = ConfigDict(extra="forbid", strict=True)


class _OpenAIModel(BaseModel):
    # OpenAI clients send fields this server does not know (or ignores): keep them in
    # `model_extra`; the handler logs them, or refuses them in strict mode.
    model_config = ConfigDict(extra="allow", strict=True)


class GenerateRequest(_Body):
    prompt: Text = Field(min_length=1)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    sla_level: int = Field(0, ge=0, le=MAX_SLA_LEVEL)
    """Service class, higher = more important (the priority score's SLA term)."""
    stream: bool = False


class StreamOptions(_OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """vLLM's extension: every chunk carries the usage so far."""


class ResponseFormat(_OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]


class _OpenAIBody(_OpenAIModel):
    model: Text | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """None: OpenAI's default, 1.0 (sampled)."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    """vLLM's extension; 0 or -1: all tokens."""
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    user: str | None = None
    sla_level: int = Field(0, ge=0, le=MAX_SLA_LEVEL)
    """Extension (pass with the client's `extra_body`): the request's service class."""

    @model_validator(mode="after")
    def _neutral_or_supported(self) -> _OpenAIBody:
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.stop is not None and not isinstance(self.stop, str) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 strings")
        return self


class CompletionRequest(_OpenAIBody):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    """Text or token ids; a list of them is a batch (choices indexed prompt * n + j)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: Text | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of must equal n (no beam search or best-of ranking)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self


class ContentPart(_OpenAIModel):
    type: Literal["text"]
    text: Text


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart]
    """Required: OpenAI lets an assistant turn carry tool calls instead, and this server
    has no tools, so a message without content would be an empty turn said silently."""
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    """vLLM's extension: end the rendered prompt with the assistant's turn."""

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                f"response_format '{self.response_format.type}' is not supported (no guided decoding)"
            )
        return self


# ------------------------------------------------------------------------------ errors
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server sends, whatever the status."""

    error: ErrorDetail


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


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text a client sent back to it in an error message may
    hold a lone surrogate, which UTF-8 cannot encode; then it is escaped (\\ud800)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    return SafeJSONResponse(err.body, status_code=err.status, headers=err.headers)


_HTTP_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def http_error(status: int, detail: str, headers: dict[str, str] | None = None) -> APIError:
    """A Starlette/FastAPI HTTPException (unknown path, wrong method) in OpenAI's shape."""
    error_type = _HTTP_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return APIError(
        status, detail, error_type=error_type, code=detail.lower().replace(" ", "_"), headers=headers
    )


def retry_after_header(seconds: float | None) -> dict[str, str]:
    return {} if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


def validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the first problem, and the field (OpenAI's `param`)."""
    first = err.errors()[0]
    # Union members add their type to the location ("prompt.str"): name the field only.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not str(p).startswith(("str", "list["))]
    loc = [p for p in loc if not p.startswith(("function-after", "int", "bool"))]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return f"invalid JSON body: {detail}", None
    if kind == "extra_forbidden":
        return f"unknown or unsupported field '{param}'", param
    if kind == "missing":
        return (f"missing field '{param}'", param) if param else ("missing JSON request body", None)
    if not param and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object (Content-Type: application/json)", None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else f"request body: {message}"), param
