"""A bounded schemathesis run against the OpenAPI document the server publishes: generated
bodies (valid and invalid) for every route, no 5xx, and every error in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from preempt.serve import create_app
from tests.serve.conftest import LiveServer, running_server, serve_config

schemathesis = pytest.importorskip("schemathesis")

# A short context bounds every generated request's work (max_tokens <= 63).
CONFIG = serve_config(model={"max_model_len": 64})
schema = schemathesis.openapi.from_dict(create_app(CONFIG).openapi())


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LiveServer]:
    with running_server(CONFIG, max_queue=64) as server:
        yield server


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same cases every run
)
def test_no_5xx_and_openai_shaped_errors(case, fuzz_server: LiveServer) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=60)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]
