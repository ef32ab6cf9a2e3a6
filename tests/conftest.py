"""Shared test helpers: small configs and hand-made requests."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.config import EngineConfig, build_config
from preempt.core.request import Request


def make_request(
    request_id: int,
    prompt_len: int,
    output_len: int,
    *,
    arrival_s: float = 0.0,
    sla_level: int = 0,
    seed: int = 0,
) -> Request:
    rng = np.random.default_rng([seed, request_id])
    return Request(
        request_id=request_id,
        arrival_s=arrival_s,
        prompt_token_ids=rng.integers(32, 127, size=prompt_len, dtype=np.int32),
        max_tokens=output_len,
        target_output_tokens=output_len,
        sla_level=sla_level,
    )


def small_config(**sections) -> EngineConfig:
    """A config for fast engine tests: float64 tiny model, small pool, small batches, one
    torch thread (two OpenMP threads on 2 shared cores stall each other badly)."""
    data = {
        "model": {"backend": "tiny", "dtype": "float64", "max_model_len": 4096, "num_threads": 1},
        "cache": {"block_size": 4, "num_blocks": 256},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return build_config(data)


@pytest.fixture
def request_factory():
    return make_request


@pytest.fixture
def no_wandb_network(monkeypatch):
    """No key, and a server address nothing listens on: any attempt to go online fails."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
