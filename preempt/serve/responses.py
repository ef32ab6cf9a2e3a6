"""The answer side of the generation routes: what a choice's answer is made of (`Delta`,
`Choice`), and how it is written out: merged deltas, usage, the logprobs formats of
completions and chat, `/generate`'s end fields, the error of an aborted request, server-sent
events, and the streaming response that aborts its requests however it ends.

Plain functions of deltas, choices and the tokenizer: no engine, no request parsing (that is
`preempt.serve.handlers`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from preempt.engine.sampling import Sample
from preempt.serve.engine_loop import EndEvent, RequestStream
from preempt.serve.protocol import APIError

SSE_DONE = b"data: [DONE]\n\n"


class Delta(NamedTuple):
    """A piece of one choice's answer: new text and the tokens that made it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Sample]
    finish_reason: str | None = None
    end: EndEvent | None = None  # set on the choice's last delta
    error: APIError | None = None


@dataclass
class Choice:
    index: int
    stream: RequestStream
    prompt_ids: list[int]
    stops: tuple[str, ...]
    min_tokens: int
    num_tokens: int = 0  # output tokens kept (a stop string drops those after it)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    if _is_byte_tokenizer(tokenizer):
        return [token_id]  # the byte tokenizer: a token is one byte
    return list(tokenizer.decode([token_id]).encode("utf-8"))


def _is_byte_tokenizer(tokenizer: Any) -> bool:
    return getattr(tokenizer, "vocab_size", None) == 256 and not hasattr(tokenizer, "_tokenizer")


def token_label(tokenizer: Any, token_id: int) -> str:
    """A token as logprobs name it: its text, or, for a byte that is not UTF-8 by itself
    (0x80-0xff: every one decodes to U+FFFD alone), OpenAI's `bytes:\\xNN` form, so that
    different tokens never share a name (completions' top_logprobs is keyed by it)."""
    if _is_byte_tokenizer(tokenizer) and token_id >= 0x80:
        return f"bytes:\\x{token_id:02x}"
    return token_text(tokenizer, token_id)


def completion_logprobs(tokenizer: Any, delta: Delta, offset: int, echo: str) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    position = offset
    if echo:  # the prompt's tokens: their logprobs are not computed (null)
        for token_id in tokenizer.encode(echo):
            tokens.append(token_label(tokenizer, token_id))
            token_logprobs.append(None)
            top.append(None)
            offsets.append(position)
            position += len(token_text(tokenizer, token_id))
    for sample in delta.logprobs:
        tokens.append(token_label(tokenizer, sample.token_id))
        token_logprobs.append(sample.logprob)
        entries: dict[str, float] = {}
        for t, lp in sample.top_logprobs:  # most likely first: a shared name keeps the likelier
            entries.setdefault(token_label(tokenizer, t), lp)
        top.append(entries)
        offsets.append(position)
        position += len(token_text(tokenizer, sample.token_id))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, delta: Delta) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_label(tokenizer, token_id),
            "logprob": logprob,
            "bytes": token_bytes(tokenizer, token_id),
        }

    content = [
        {**entry(s.token_id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]}
        for s in delta.logprobs
    ]
    return {"content": content}


def merge(deltas: list[Delta]) -> Delta:
    last = deltas[-1]
    return Delta(
        last.index,
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        [s for d in deltas for s in d.logprobs],
        last.finish_reason,
        last.end,
        last.error,
    )


def choice_usage(choice: Choice) -> dict[str, int]:
    num_prompt = len(choice.prompt_ids)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": choice.num_tokens,
        "total_tokens": num_prompt + choice.num_tokens,
    }


def usage(choices: list[Choice], n: int) -> dict[str, int]:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
    num_prompt = sum(len(c.prompt_ids) for c in choices if c.index % n == 0)
    num_out = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


def generate_end_fields(end: EndEvent) -> dict[str, Any]:
    num_out = len(end.output_token_ids)
    return {
        "finish_reason": end.finish_reason,
        "final_state": end.final_state,
        "num_preemptions": end.num_preemptions,
        "preemption_failed": end.preemption_failed,
        "ttft_s": end.ttft_s,
        "e2e_s": end.e2e_s,
        "usage": {
            "prompt_tokens": end.num_prompt_tokens,
            "completion_tokens": num_out,
            "total_tokens": end.num_prompt_tokens + num_out,
        },
    }


def end_error(end: EndEvent) -> APIError:
    """The error for a request that ended ABORTED."""
    reason = end.reason or "aborted"
    if reason.startswith(("prompt_too_long", "exceeds_kv_capacity")):
        return APIError(400, reason, param="max_tokens", code=reason.split(":")[0])
    if reason == "server_shutdown":
        return APIError(503, "the server is shutting down", error_type="service_unavailable", code=reason)
    return APIError(500, f"request aborted: {reason}", error_type="server_error", code="aborted")


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def consume(future: asyncio.Future[Any]) -> None:
    """Done callback of a future nobody awaits: read its outcome. A cancelled `gather`
    finishes with CancelledError as its *exception*, which asyncio logs with a traceback
    ("exception was never retrieved") unless it is read."""
    if not future.cancelled():
        future.exception()


async def client_gone(http: HTTPRequest) -> None:
    """Returns when the client disconnects (the body is already read, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class EngineStreamResponse(StreamingResponse):
    """A streaming response that aborts its requests however the response ends: client
    gone (Starlette cancels the stream), a failed send, or a body never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
