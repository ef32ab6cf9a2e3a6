"""Sampling parameters real clients send, through the official `openai` client, each
whole and streamed: stop strings and ids, min_tokens, seed, n, logprobs, echo,
penalties, continuous usage stats, the chat default max_tokens, unknown fields."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from preempt.core.config import EngineConfig
from tests.serve.conftest import AUTH, LiveServer, running_server, serve_config

MODEL = "tiny-2l"


def whole_and_streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, dict[int, str], list[Any]]:
    """A completion both ways: (whole response, streamed text per choice index, chunks)."""
    whole = client.completions.create(model=MODEL, **kwargs)
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return whole, texts, chunks


def finish_reasons(chunks: list[Any]) -> dict[int, str]:
    return {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}


def test_stop_strings_cut_whole_and_streamed(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0)
    text = base.choices[0].text
    stop = text[12:15]  # 3 characters: spans several one-byte tokens, so several chunks
    expected = text[: text.find(stop)]
    whole, streamed, chunks = whole_and_streamed(
        client, prompt="Once upon", max_tokens=40, temperature=0, stop=[stop, "never-there"]
    )
    assert whole.choices[0].text == expected == streamed[0]
    assert whole.choices[0].finish_reason == "stop" == finish_reasons(chunks)[0]
    assert whole.usage.completion_tokens < 40  # the engine stopped, not only the text


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI) -> None:
    # /generate returns token ids: the greedy output of the same prompt ("Hi").
    base = httpx.post(
        f"{client.base_url}".replace("/v1/", "/generate"),
        json={"prompt": "Hi", "max_tokens": 20},
        headers=AUTH,
        timeout=30,
    ).json()
    ids = base["token_ids"]
    stop_id = ids[5]
    first = ids.index(stop_id)  # its first occurrence ends the request
    body = {"prompt": [72, 105], "max_tokens": 20, "temperature": 0, "stop_token_ids": [stop_id]}
    stopped = httpx.post(f"{client.base_url}completions", json=body, headers=AUTH, timeout=30).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first + 1  # the stop token is output
    # min_tokens masks the stop token until then: at least that many tokens come.
    body["min_tokens"] = first + 3
    later = httpx.post(f"{client.base_url}completions", json=body, headers=AUTH, timeout=30).json()
    assert later["usage"]["completion_tokens"] >= first + 3


def test_seed_is_reproducible_and_n_choices_are_the_seeded_singles(client: openai.OpenAI) -> None:
    kwargs = {"prompt": "seeded", "max_tokens": 8, "temperature": 1.0}
    one = client.completions.create(model=MODEL, seed=7, **kwargs).choices[0].text
    assert client.completions.create(model=MODEL, seed=7, **kwargs).choices[0].text == one
    assert client.completions.create(model=MODEL, seed=8, **kwargs).choices[0].text != one
    whole, streamed, chunks = whole_and_streamed(client, n=3, seed=7, **kwargs)
    texts = {c.index: c.text for c in whole.choices}
    assert sorted(texts) == [0, 1, 2] and texts == streamed
    # vLLM's rule: choice j is the single request with seed + j.
    assert (
        texts[0] == one
        and texts[1] == client.completions.create(model=MODEL, seed=8, **kwargs).choices[0].text
    )
    assert whole.usage.prompt_tokens == len("seeded") and whole.usage.completion_tokens == 24
    assert finish_reasons(chunks) == {0: "length", 1: "length", 2: "length"}


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    whole, streamed, chunks = whole_and_streamed(
        client, prompt="Log", max_tokens=6, temperature=0, logprobs=3, echo=True
    )
    choice = whole.choices[0]
    assert choice.text.startswith("Log") and streamed[0] == choice.text
    lp = choice.logprobs
    assert lp.token_logprobs[:3] == [None, None, None]  # echoed prompt: not computed
    generated = lp.token_logprobs[3:]
    assert len(generated) == 6 and all(v <= 0 for v in generated)
    for token, chosen, top in zip(lp.tokens[3:], generated, lp.top_logprobs[3:], strict=True):
        # Exactly three: bytes that are not UTF-8 alone are named `bytes:\xNN` (OpenAI's
        # form), not by the "\ufffd" they all decode to, so no two entries share a key.
        assert token in top and len(top) == 3
        assert all("\ufffd" not in name for name in top)
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the top-1
        # most likely first, and real log-probabilities of distinct outcomes
        values = list(top.values())
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(chosen)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    streamed_lps = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed_lps == lp.token_logprobs


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 and len(e.bytes) == 1 for e in content)
    assert bytes(e.bytes[0] for e in content).decode("utf-8", "replace") == whole.choices[0].message.content
    stream = client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kwargs)
    entries = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in entries] == [e.logprob for e in content]


def test_penalties_change_output_and_neutral_values_do_not(client: openai.OpenAI) -> None:
    kwargs = {"prompt": "aaaa", "max_tokens": 30, "temperature": 0}
    plain = client.completions.create(model=MODEL, **kwargs).choices[0].text
    neutral = client.completions.create(
        model=MODEL, frequency_penalty=0, presence_penalty=0, echo=False, logit_bias={}, best_of=1, **kwargs
    )
    assert neutral.choices[0].text == plain
    penalized = client.completions.create(model=MODEL, frequency_penalty=2.0, **kwargs).choices[0].text
    assert penalized != plain
    # Frequency penalty makes repeats costly: the most repeated byte repeats less.
    assert max(map(penalized.count, set(penalized))) <= max(map(plain.count, set(plain)))
    repetition = (
        client.completions.create(model=MODEL, extra_body={"repetition_penalty": 1.5}, **kwargs)
        .choices[0]
        .text
    )
    assert repetition != plain


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="usage",
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 7 and len(counts) == len(chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len("usage")


def test_chat_max_tokens_defaults_to_serve_default_max_tokens(client: openai.OpenAI) -> None:
    default = EngineConfig().serve.default_max_tokens
    assert default == 256  # docs/serving.md says so
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert whole.usage.completion_tokens == default and whole.choices[0].finish_reason == "length"
    # Less when the context leaves less: tiny-2l serves 2048 tokens here.
    content = "x" * 1900
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0
    )
    assert whole.usage.total_tokens == 2048 and whole.usage.completion_tokens < default
    # Completions keep OpenAI's and vLLM's 16.
    assert client.completions.create(model=MODEL, prompt="hi").usage.completion_tokens == 16


def test_chat_max_tokens_default_is_configurable() -> None:
    config = serve_config(serve={"default_max_tokens": 5})
    with running_server(config) as server:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        body = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).json()
        assert body["usage"]["completion_tokens"] == 5
    # None: vLLM's and OpenAI's default, all the context the prompt leaves.
    with running_server(serve_config(serve={"default_max_tokens": None})) as server:
        chat["messages"] = [{"role": "user", "content": "x" * 1900}]
        body = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert body["usage"]["total_tokens"] == 2048 and body["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_and_guidellm_body_are_accepted(live: LiveServer) -> None:
    # What guidellm sends (it failed 30 of 30 with 400 before), plus fields we do not know.
    body = {
        "model": MODEL,
        "prompt": "bench",
        "max_tokens": 4,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "some_future_field": {"x": 1},
        "user": "u1",
    }
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    chat.update({"tools": [], "parallel_tool_calls": False, "response_format": {"type": "text"}})
    assert (
        httpx.post(f"{live.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=30).status_code == 200
    )


@pytest.fixture(scope="module")
def strict() -> Iterator[LiveServer]:
    with running_server(serve_config(), strict_fields=True) as server:
        yield server


def test_strict_mode_refuses_unknown_fields(strict: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "some_future_field": 1}
    response = httpx.post(f"{strict.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "some_future_field"
    del body["some_future_field"]
    assert httpx.post(f"{strict.url}/v1/completions", json=body, timeout=30).status_code == 200
