"""The generation routes of `preempt serve`: validate, submit, answer whole or streamed.

Owns: checking a request body and turning it into engine requests (one per prompt and
choice, each with its `SamplingParams`), the per-choice text pipeline (incremental
detokenization, stop strings held back across chunk boundaries) and which answer each
route assembles, whole JSON or server-sent events, for `/generate`, `/v1/completions` and
`/v1/chat/completions`. The pieces an answer is written with (deltas, usage, logprobs,
events) are `preempt.serve.responses`'.

It must never touch the engine: everything goes through the `EngineLoop`'s thread-safe
`submit`, `abort` and `finish`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from preempt.core.block_pool import blocks_needed
from preempt.core.request import RequestState
from preempt.engine.sampling import SamplingParams, StopStringMatcher
from preempt.serve.chat import ChatFormat, ChatTemplateError
from preempt.serve.engine_loop import EngineLoop, Rejected, RequestStream, TokensEvent
from preempt.serve.protocol import (
    DEFAULT_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SafeJSONResponse,
    _OpenAIBody,
    error_response,
    retry_after_header,
)
from preempt.serve.responses import (
    SSE_DONE,
    Choice,
    Delta,
    EngineStreamResponse,
    chat_logprobs,
    choice_usage,
    client_gone,
    completion_logprobs,
    consume,
    end_error,
    generate_end_fields,
    merge,
    sse,
    usage,
)

logger = logging.getLogger("preempt.server")


def _encode(tokenizer: Any, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as err:  # a lone surrogate that reached us some other way
        raise APIError(400, f"{param}: not valid Unicode text ({err.reason})", param=param) from None


class Handlers:
    """The generation routes; `tokenizer` is the served model's (bytes or tokenizer.json)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        tokenizer: Any,
        chat_format: ChatFormat,
        eos_token_ids: frozenset[int] = frozenset(),
        strict_fields: bool = False,
        default_max_tokens: int | None = None,
    ) -> None:
        self.loop = engine_loop
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.eos_token_ids = eos_token_ids
        self.strict_fields = strict_fields
        self.default_max_tokens = default_max_tokens  # serve.default_max_tokens (chat)

    # ----------------------------------------------------------------- routes
    async def generate(self, body: GenerateRequest, http: HTTPRequest) -> Response:
        prompt_ids = _encode(self.tokenizer, body.prompt, "prompt")
        self._check_lengths(prompt_ids, body.max_tokens)
        stream = self._submit_one(
            prompt_ids, body.max_tokens, SamplingParams(body.temperature), body.sla_level
        )
        choice = Choice(0, stream, prompt_ids, (), 0)
        rid = f"gen-{stream.request.request_id}"
        if body.stream:
            return self._sse_response([choice], self._generate_events(choice, rid))
        deltas = await self._collect([choice], http)
        if deltas is None:
            return Response(status_code=499)  # client closed the request: nobody reads this
        end, error = deltas[0][-1].end, deltas[0][-1].error
        if error is not None:
            return error_response(error)
        return SafeJSONResponse(
            {
                "id": rid,
                "text": "".join(d.text for d in deltas[0]),
                "token_ids": end.output_token_ids,
                **generate_end_fields(end),
            }
        )

    async def completions(self, body: CompletionRequest, http: HTTPRequest) -> Response:
        self._check_fields(body, http)
        self._check_model(body.model)
        prompts = self._completion_prompts(body.prompt)
        choices = self._submit(body, prompts, body.max_tokens, body.logprobs)
        head = self._head("cmpl", "text_completion")
        echo = [self.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
        n = body.n or 1

        def choice_of(delta: Delta, offset: int, first: bool) -> dict[str, Any]:
            prefix = echo[delta.index // n] if first else ""  # echo: the prompt leads the text
            text = prefix + delta.text
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(self.tokenizer, delta, offset, prefix)
            return {
                "index": delta.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }

        if body.stream:
            return self._sse_response(choices, self._openai_events(body, choices, head, False, choice_of))
        deltas = await self._collect(choices, http)
        if deltas is None:
            return Response(status_code=499)
        out = []
        for per_choice in deltas:
            if per_choice[-1].error is not None:
                return error_response(per_choice[-1].error)
            merged = merge(per_choice)
            out.append(choice_of(merged, 0, True))
        return SafeJSONResponse({**head, "choices": out, "usage": usage(choices, n)})

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        self._check_fields(body, http)
        self._check_model(body.model)
        messages = [(m.role, m.text) for m in body.messages]
        try:
            text = self.chat_format.render(messages, body.add_generation_prompt)
        except ChatTemplateError as err:
            raise APIError(400, str(err), param="messages") from None
        prompt_ids = _encode(self.tokenizer, text, "messages")
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        choices = self._submit(body, [prompt_ids], max_tokens, num_logprobs, is_chat=True)
        head = self._head("chatcmpl", "chat.completion")

        def logprobs_of(delta: Delta) -> dict[str, Any] | None:
            return None if num_logprobs is None else chat_logprobs(self.tokenizer, delta)

        if body.stream:
            head = {**head, "object": "chat.completion.chunk"}

            def chunk_choice(delta: Delta, offset: int, first: bool) -> dict[str, Any]:
                content: dict[str, Any] = (
                    {"role": "assistant", "content": ""} if first else {"content": delta.text}
                )
                return {
                    "index": delta.index,
                    "delta": content,
                    "logprobs": logprobs_of(delta),
                    "finish_reason": delta.finish_reason,
                }

            return self._sse_response(choices, self._openai_events(body, choices, head, True, chunk_choice))
        deltas = await self._collect(choices, http)
        if deltas is None:
            return Response(status_code=499)
        out = []
        for per_choice in deltas:
            if per_choice[-1].error is not None:
                return error_response(per_choice[-1].error)
            merged = merge(per_choice)
            message = {"role": "assistant", "content": merged.text}
            out.append(
                {
                    "index": merged.index,
                    "message": message,
                    "logprobs": logprobs_of(merged),
                    "finish_reason": merged.finish_reason,
                }
            )
        return SafeJSONResponse({**head, "choices": out, "usage": usage(choices, body.n or 1)})

    # ----------------------------------------------------------------- checks
    def _check_fields(self, body: _OpenAIBody, http: HTTPRequest) -> None:
        extra = sorted(body.model_extra or {})
        if not extra:
            return
        if self.strict_fields:
            raise APIError(400, f"unknown or unsupported field '{extra[0]}' (strict mode)", param=extra[0])
        logger.warning("%s: ignoring unknown fields %s", http.url.path, ", ".join(map(repr, extra)))

    def _check_model(self, model: str | None) -> None:
        name = self.loop.facts.model_name
        if model is not None and model != name:
            raise APIError(
                404,
                f"model '{model}' not found; this server serves '{name}'",
                param="model",
                code="model_not_found",
            )

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [_encode(self.tokenizer, prompt, "prompt")]
        if all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [_encode(self.tokenizer, p, "prompt") for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        vocab_size = self.loop.facts.vocab_size
        for ids in prompts:
            if any(not 0 <= t < vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return prompts

    def _check_lengths(self, prompt_ids: list[int], max_tokens: int) -> None:
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

    def context_left(self, num_prompt_tokens: int) -> int:
        """What the context and the KV cache leave after the prompt (vLLM's and OpenAI's
        default max_tokens of a chat request)."""
        facts = self.loop.facts
        limit = min(facts.max_model_len, facts.num_blocks * facts.block_size)
        return max(1, min(limit - num_prompt_tokens, facts.max_model_len - 1))

    def chat_max_tokens(self, num_prompt_tokens: int) -> int:
        """The max_tokens of a chat request that gives none: `serve.default_max_tokens`, or
        what the context leaves when that is less (None: all it leaves, as vLLM)."""
        left = self.context_left(num_prompt_tokens)
        return left if self.default_max_tokens is None else min(self.default_max_tokens, left)

    # ----------------------------------------------------------------- submit
    def _check_token_ids(self, ids: Any, param: str) -> None:
        vocab_size = self.loop.facts.vocab_size
        bad = sorted(t for t in ids if not 0 <= int(t) < vocab_size)
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is not in [0, {vocab_size})", param=param)

    def _sampling(self, body: _OpenAIBody, num_logprobs: int | None, index: int) -> SamplingParams:
        self._check_token_ids(body.stop_token_ids or (), "stop_token_ids")
        self._check_token_ids((int(k) for k in body.logit_bias or {}), "logit_bias")
        stop_ids = set(body.stop_token_ids or ())
        if not body.ignore_eos:
            stop_ids |= self.eos_token_ids
        seed = None if body.seed is None else body.seed + index  # vLLM: choice j gets seed + j
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            seed=seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
            num_logprobs=num_logprobs,
            min_tokens=body.min_tokens or 0,
            stop_token_ids=frozenset(stop_ids),
        )

    def _submit(
        self,
        body: _OpenAIBody,
        prompts: Sequence[list[int]],
        max_tokens: int | None,
        num_logprobs: int | None,
        is_chat: bool = False,
    ) -> list[Choice]:
        n = body.n or 1
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        plans = []
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            limit = max_tokens
            if limit is None:
                limit = self.chat_max_tokens(len(ids)) if is_chat else DEFAULT_MAX_TOKENS
            if body.min_tokens and body.min_tokens > limit:
                raise APIError(
                    400, f"min_tokens ({body.min_tokens}) > max_tokens ({limit})", param="min_tokens"
                )
            self._check_lengths(ids, limit)
            plans.append((ids, limit))
        choices: list[Choice] = []
        try:
            for p, (ids, limit) in enumerate(plans):
                for j in range(n):
                    index = p * n + j
                    stream = self._submit_one(
                        ids, limit, self._sampling(body, num_logprobs, j), body.sla_level
                    )
                    choices.append(Choice(index, stream, ids, stops, body.min_tokens or 0))
        except APIError:
            for choice in choices:  # all or nothing: a refused choice takes its siblings along
                self.loop.abort(choice.stream, "sibling_rejected")
            raise
        return choices

    def _submit_one(
        self, ids: list[int], max_tokens: int, sampling: SamplingParams, sla: int
    ) -> RequestStream:
        try:
            return self.loop.submit(ids, max_tokens, sampling, sla)
        except Rejected as err:
            self.loop.metrics.observe_rejected(err.code)
            kind = "rate_limit_error" if err.status == 429 else "service_unavailable"
            raise APIError(
                err.status,
                str(err),
                error_type=kind,
                code=err.code,
                headers=retry_after_header(err.retry_after_s),
            ) from None

    # ----------------------------------------------------------------- one choice's text
    async def _deltas(self, choice: Choice) -> AsyncIterator[Delta]:
        """The choice's answer as it arrives; the last delta carries `end` (or `error`)."""
        decoder = self.tokenizer.stream_decoder()
        matcher = StopStringMatcher(choice.stops) if choice.stops else None
        stopped = False
        async for event in choice.stream.events():
            if isinstance(event, TokensEvent):
                if stopped:
                    continue  # generated after the stop string: dropped
                if matcher is None:
                    choice.num_tokens += len(event.token_ids)
                    yield Delta(choice.index, decoder.push(event.token_ids), event.token_ids, event.logprobs)
                    continue
                text, kept = [], 0
                for k, token_id in enumerate(event.token_ids):
                    piece = decoder.push([token_id])
                    kept = k + 1
                    choice.num_tokens += 1
                    if choice.num_tokens <= choice.min_tokens:  # no stop before min_tokens
                        text.append(matcher.flush() + piece)
                        continue
                    text.append(matcher.push(piece))
                    if matcher.is_stopped:
                        stopped = True
                        self.loop.finish(choice.stream)
                        break
                ids = event.token_ids[:kept]
                yield Delta(choice.index, "".join(text), ids, event.logprobs[:kept])
            elif event.final_state == RequestState.ABORTED.value:
                yield Delta(choice.index, "", [], [], None, event, end_error(event))
            else:
                tail = "" if stopped else decoder.flush()
                if matcher is not None and not stopped:
                    tail = matcher.push(tail) + matcher.close()
                    stopped = matcher.is_stopped
                reason = "stop" if stopped else event.finish_reason
                yield Delta(choice.index, tail, [], [], reason, event)

    async def _collect(self, choices: list[Choice], http: HTTPRequest) -> list[list[Delta]] | None:
        """Every choice's deltas; None (everything aborted) if the client goes away first."""

        async def one(choice: Choice) -> list[Delta]:
            return [delta async for delta in self._deltas(choice)]

        work = asyncio.gather(*(one(c) for c in choices))
        gone = asyncio.ensure_future(client_gone(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler itself is cancelled
            gone.cancel()
            gone.add_done_callback(consume)
            is_gone = not work.done()
            if is_gone:
                work.cancel()
                work.add_done_callback(consume)
                for choice in choices:  # each ends ABORTED(client_disconnected), blocks freed
                    self.loop.abort(choice.stream)
        return None if is_gone else work.result()

    async def _merged(self, choices: list[Choice]) -> AsyncIterator[Delta]:
        """All choices' deltas as they come (one stream for n > 1 or a prompt batch)."""
        if len(choices) == 1:
            async for delta in self._deltas(choices[0]):
                yield delta
            return
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in self._deltas(choice):
                    await queue.put(delta)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            remaining = len(tasks)
            while remaining:
                delta = await queue.get()
                if delta is None:
                    remaining -= 1
                else:
                    yield delta
        finally:
            for task in tasks:
                task.cancel()

    # ----------------------------------------------------------------- formats
    def _head(self, prefix: str, kind: str) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.loop.facts.model_name,
        }

    def _sse_response(self, choices: list[Choice], body: AsyncIterator[bytes]) -> Response:
        def on_close() -> None:
            for choice in choices:
                if not choice.stream.is_done:
                    self.loop.abort(choice.stream)

        return EngineStreamResponse(body, on_close)

    async def _generate_events(self, choice: Choice, rid: str) -> AsyncIterator[bytes]:
        async for delta in self._deltas(choice):
            if delta.error is not None:
                yield sse(delta.error.body)
            elif delta.end is None:
                yield sse({"id": rid, "text": delta.text, "token_ids": delta.token_ids})
            else:
                yield sse({"id": rid, "text": delta.text, "token_ids": [], **generate_end_fields(delta.end)})
        yield SSE_DONE

    async def _openai_events(
        self,
        body: _OpenAIBody,
        choices: list[Choice],
        head: dict[str, Any],
        is_chat: bool,
        choice_of: Callable[[Delta, int, bool], dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        # A token may end mid-character, and text may be the start of a stop string: the
        # pipeline holds both back, so the streamed pieces concatenate to the whole text.
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        n = body.n or 1
        sent = {c.index: 0 for c in choices}  # characters streamed per choice
        started: set[int] = set()
        by_index = {c.index: c for c in choices}

        def chunk(delta: Delta) -> bytes:
            first = delta.index not in started
            started.add(delta.index)
            choice = choice_of(delta, sent[delta.index], first)
            sent[delta.index] += len(choice.get("text") or choice.get("delta", {}).get("content") or "")
            payload = {**head, "choices": [choice]}
            if include_usage or continuous:
                payload["usage"] = choice_usage(by_index[delta.index]) if continuous else None
            return sse(payload)

        if is_chat:
            for choice in choices:
                yield chunk(Delta(choice.index, "", [], []))
        async for delta in self._merged(choices):
            if delta.error is not None:
                yield sse(delta.error.body)
                break
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                yield chunk(delta)
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(choices, n)})
        yield SSE_DONE
