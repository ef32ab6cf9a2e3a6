"""Model runners: paged, chunked, batched execution reproduces the naive reference; sampling
does not depend on batching; the null runner is deterministic; the KV pool's block copies."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from preempt.core.config import EngineConfig, build_config
from preempt.core.request import Request, ScheduledChunk
from preempt.engine.model_runner import (
    ModelRunner,
    NullModelRunner,
    TinyModelRunner,
    create_model_runner,
    sample_token,
    token_seed,
)
from preempt.kv.kv_cache import KVCache
from preempt.model.tiny import generate_naive


def config(backend: str = "tiny", dtype: str = "float64", seed: int = 0) -> EngineConfig:
    return build_config({"seed": seed, "model": {"backend": backend, "dtype": dtype}})


def make_request(request_id: int, prompt_len: int, output_len: int, temperature: float = 0.0) -> Request:
    rng = np.random.default_rng([7, request_id])
    return Request(
        request_id=request_id,
        arrival_s=0.0,
        prompt_token_ids=rng.integers(0, 256, size=prompt_len, dtype=np.int32),
        max_tokens=output_len,
        target_output_tokens=output_len,
        temperature=temperature,
    )


def drive(
    runner: ModelRunner,
    requests: list[Request],
    block_size: int,
    num_blocks: int,
    seed: int,
    chunk_sizes: tuple[int, ...] = (1, 3, 8, 16),
) -> None:
    """A stand-in engine: random chunking, random batch membership and order, blocks taken
    from a shuffled free list as needed, request state advanced from the runner's output."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    while not all(r.is_finished_generating for r in requests):
        active = [r for r in requests if not r.is_finished_generating]
        batch = [r for r in active if rng.random() < 0.7] or active[:1]
        rng.shuffle(batch)
        chunks = []
        for request in batch:
            num_new = min(request.num_tokens - request.num_computed_tokens, rng.choice(chunk_sizes))
            needed = -(-(request.num_computed_tokens + num_new) // block_size)
            while len(request.block_ids) < needed:
                request.block_ids.append(free.pop())
            chunks.append(ScheduledChunk(request, num_new))
        tokens = runner.execute(chunks)
        assert len(tokens) == len(chunks)
        for chunk, token in zip(chunks, tokens, strict=True):
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            assert (token is not None) == (request.num_computed_tokens == request.num_tokens)
            if token is not None:
                assert 0 <= token < runner.vocab_size
                request.output_token_ids.append(token)


PROMPT_LENS = [1, 2, 5, 13, 16, 17, 31, 48]


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_batched_greedy_matches_naive(block_size: int) -> None:
    num_blocks = 128
    runner = TinyModelRunner(config(), num_blocks, block_size)
    requests = [make_request(i, n, 10) for i, n in enumerate(PROMPT_LENS)]
    drive(runner, requests, block_size, num_blocks, seed=block_size)
    for request in requests:
        expected = generate_naive(runner.model, request.prompt_token_ids.tolist(), 10)
        assert request.output_token_ids == expected, request.request_id


def test_masked_prefixes_of_dropped_heads_match_the_naive_reference() -> None:
    """A request whose KV heads a lossy restore dropped attends, in those heads, only to keys
    from the masked position on: batched and chunked (decode groups and prefill chunks,
    next to requests with no masked head) it computes what the naive model computes with
    the same masked prefixes."""
    runner = TinyModelRunner(config(), 128, 4)
    cfg = runner.model.cfg
    masked_until = np.zeros((cfg.num_layers, cfg.num_kv_heads), dtype=np.int64)
    masked_until[0, 1], masked_until[1, 0] = 9, 14
    requests = [make_request(i, n, 10) for i, n in enumerate([5, 13, 17])]
    requests[1].kv_masked_until = masked_until
    drive(runner, requests, 4, 128, seed=3)
    for request in requests:
        masked = None if request.kv_masked_until is None else torch.from_numpy(masked_until)
        expected = generate_naive(runner.model, request.prompt_token_ids.tolist(), 10, masked_until=masked)
        assert request.output_token_ids == expected, request.request_id
    unmasked = generate_naive(runner.model, requests[1].prompt_token_ids.tolist(), 10)
    assert requests[1].output_token_ids != unmasked  # the mask really changed the computation


def test_execute_does_not_mutate_requests() -> None:
    runner = TinyModelRunner(config(), 16, 4)
    request = make_request(0, 6, 3)
    request.block_ids = [3, 9]
    assert runner.execute([ScheduledChunk(request, 4)]) == [None]
    assert runner.execute([ScheduledChunk(request, 6)]) != [None]
    assert request.num_computed_tokens == 0 and request.output_token_ids == [] and request.block_ids == [3, 9]


def test_bad_chunks_are_errors() -> None:
    runner = TinyModelRunner(config(), 16, 4)
    request = make_request(0, 6, 3)
    request.block_ids = [3]
    with pytest.raises(ValueError, match="runs past"):
        runner.execute([ScheduledChunk(request, 7)])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([ScheduledChunk(request, 6)])
    assert runner.execute([]) == []


def test_sampling_is_independent_of_batching_and_chunking() -> None:
    temps = [0.7, 1.0, 1.5]
    runner_a = TinyModelRunner(config(seed=11), 128, 4)
    alone = [make_request(i, 9 + 4 * i, 12, temperature=t) for i, t in enumerate(temps)]
    for request in alone:  # each request on its own, one token per step
        drive(runner_a, [request], 4, 128, seed=1, chunk_sizes=(1,))
    runner_b = TinyModelRunner(config(seed=11), 128, 4)
    batched = [make_request(i, 9 + 4 * i, 12, temperature=t) for i, t in enumerate(temps)]
    others = [make_request(100 + i, 20, 5) for i in range(3)]  # greedy neighbours
    drive(runner_b, batched + others, 4, 128, seed=2, chunk_sizes=(2, 5, 16))
    for a, b in zip(alone, batched, strict=True):
        assert a.output_token_ids == b.output_token_ids
    # Temperature really samples: not the greedy continuation, and the seed matters.
    greedy = [generate_naive(runner_a.model, r.prompt_token_ids.tolist(), 12) for r in alone]
    assert any(r.output_token_ids != g for r, g in zip(alone, greedy, strict=True))
    runner_c = TinyModelRunner(config(seed=12), 128, 4)
    other_seed = [make_request(i, 9 + 4 * i, 12, temperature=t) for i, t in enumerate(temps)]
    drive(runner_c, other_seed, 4, 128, seed=3)
    assert [r.output_token_ids for r in other_seed] != [r.output_token_ids for r in alone]


def test_sample_token() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)
    assert sample_token(logits, 0.0, seed=5) == 1
    draws = [sample_token(logits, 1.0, token_seed(0, 1, p)) for p in range(400)]
    counts = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(counts, torch.softmax(logits, 0).numpy(), atol=0.06)
    assert draws == [sample_token(logits, 1.0, token_seed(0, 1, p)) for p in range(400)]
    assert 0 <= token_seed(-3, 2**40, 7) < 2**63


def test_null_runner_is_deterministic() -> None:
    cfg = config("null")
    requests = [make_request(i, 5 + i, 4) for i in range(4)]
    runner = create_model_runner(cfg, 64, 4)
    assert isinstance(runner, NullModelRunner) and runner.kv_bytes_per_token == 0
    drive(runner, requests, 4, 64, seed=0)
    again = [make_request(i, 5 + i, 4) for i in range(4)]
    drive(create_model_runner(cfg, 64, 4), again, 4, 64, seed=9)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in again]
    assert len({t for r in requests for t in r.output_token_ids}) > 4


def test_null_backend_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from preempt.core.config import build_config\n"
        "from preempt.engine.model_runner import create_model_runner\n"
        "create_model_runner(build_config({'model': {'backend': 'null'}}), 8, 4)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_create_tiny_runner() -> None:
    runner = create_model_runner(config(dtype="float32"), 10, 16)
    assert isinstance(runner, TinyModelRunner) and runner.vocab_size == 256
    # 2 layers * (K + V) * 2 KV heads * 32 dims * 4 bytes
    assert runner.kv_bytes_per_token == 1024
    assert runner.kv_cache.k_caches[0].shape == (10, 16, 2, 32)
    assert runner.kv_cache.bytes_per_block == 16 * 1024


def test_kv_cache_block_copies() -> None:
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    assert cache.bytes_per_token == 2 * 2 * 2 * 3 * 4 and cache.bytes_per_block == 4 * cache.bytes_per_token
    data = torch.randn(2, 2, 2, 4, 2, 3)
    cache.write_blocks([4, 1], data)
    torch.testing.assert_close(cache.read_blocks([4, 1]), data)
    torch.testing.assert_close(cache.k_caches[1][4], data[1, 0, 0])
    torch.testing.assert_close(cache.v_caches[0][1], data[0, 1, 1])
    assert cache.read_blocks([0]).abs().sum() == 0  # untouched blocks stay zero
    with pytest.raises(IndexError):
        cache.read_blocks([6])
    with pytest.raises(ValueError, match="expects shape"):
        cache.write_blocks([0], data)


def test_null_decode_tokens_are_the_tokens_single_steps_return():
    # Request ids and positions across the 64-bit range, where numpy's uint64 wrap-around
    # must agree with the masked Python arithmetic bit for bit.
    runner = NullModelRunner(config("null", seed=2**40 + 7))
    requests = [
        Request(rid, 0.0, np.arange(prompt, dtype=np.int32), 50, 50)
        for rid, prompt in ((0, 1), (5, 17), (2**62 + 3, 300), (2**63 - 1, 9))
    ]
    runs = runner.decode_tokens(requests, 6)
    for request, run in zip(requests, runs, strict=True):
        stepped = []
        for _ in range(6):
            request.num_computed_tokens = request.num_tokens - 1
            (token,) = runner.execute([ScheduledChunk(request, 1)])
            stepped.append(token)
            request.output_token_ids.append(token)
        assert run == stepped
