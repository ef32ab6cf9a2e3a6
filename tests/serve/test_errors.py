"""Bad input: every error one clear message in OpenAI's shape; auth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serve.conftest import AUTH, LiveServer

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
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400),  # above MAX_N
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400),  # no best-of ranking
    ("/v1/completions", {"prompt": "hi", "suffix": "tail"}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400),  # not in the vocabulary
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [256]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),  # no content
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "\ud800"}, 400),  # lone surrogate: crashed with 500
    ("/v1/completions", {"prompt": "hi", "stop": "\udfff"}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, 400),
    ("/generate", {"prompt": "\ud800"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        400,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        400,
    ),
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


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [256]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content"),
    ],
)
def test_lenient_cases_name_the_field(live: LiveServer, path: str, body: Any, field: str) -> None:
    response = httpx.post(f"{live.url}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] or field in (error["param"] or ""), error


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


# ------------------------------------------------------------------------------ OpenAI shape
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/no/such/route", 404), ("GET", "/v1/completions", 405), ("DELETE", "/generate", 405)],
)
def test_404_and_405_are_openai_shaped(live: LiveServer, method: str, path: str, status: int) -> None:
    response = httpx.request(method, f"{live.url}{path}", headers=AUTH, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_openapi_document_states_400_not_422_and_metrics_as_text(live: LiveServer) -> None:
    doc = httpx.get(f"{live.url}/openapi.json", timeout=10).json()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
