"""Model runners: turn one step's scheduled chunks into KV writes and next tokens.

Owns: the step's input tensors and attention metadata, the model call, and sampling.
A runner must never mutate a request (the engine advances `num_computed_tokens` and
appends the returned tokens), never allocate or free blocks (it writes only into the
physical blocks `request.block_ids` names) and never decide what runs.

Sampling is a pure function of (logits, engine seed, request id, position): greedy when
`temperature == 0`, otherwise inverse-CDF sampling with a uniform drawn from a generator
seeded by (seed, request_id, position). A request's tokens therefore do not depend on
which other requests shared its steps, nor on how its prompt was chunked. A request with
its own `SamplingParams` (penalties, top-k/p, a seed, logprobs: `preempt.engine.sampling`) is
sampled row by row; with logprobs the runner returns a `Sample` instead of a bare id.

torch is imported only by the `tiny` runner, so the `null` backend starts without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from preempt.core.config import EngineConfig
from preempt.core.request import Request, ScheduledChunk
from preempt.engine.sampling import (
    Sample,
    SamplingParams,
    logprobs_of,
    process_logits,
    sample_token,
    token_seed,
    token_seeds,
)

__all__ = ["ModelRunner", "NullModelRunner", "TinyModelRunner", "sample_token", "token_seed"]

if TYPE_CHECKING:
    import torch


def _chunk_bounds(chunk: ScheduledChunk) -> tuple[int, int]:
    request, num_new = chunk
    start = request.num_computed_tokens
    end = start + num_new
    if num_new <= 0:
        raise ValueError(f"request {request.request_id}: chunk of {num_new} tokens")
    if end > request.num_tokens:
        raise ValueError(
            f"request {request.request_id}: chunk [{start}, {end}) runs past its "
            f"{request.num_tokens} known tokens"
        )
    return start, end


class ModelRunner(ABC):
    """Executes one step.

    Rules: `execute` computes the KV of positions [num_computed_tokens, num_computed_tokens
    + num_new_tokens) of each chunk's request into the blocks `request.block_ids` names,
    and returns per chunk the sampled next token if the chunk ends at `request.num_tokens`
    (the last known token), else None; a `Sample` (token id plus logprobs) when the
    request's sampling params ask for logprobs. It does not modify the requests.
    """

    vocab_size: int
    kv_bytes_per_token: int  # K and V of one token over all layers; 0 when there is no KV
    closed: bool = False

    @abstractmethod
    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | Sample | None]: ...

    def close(self) -> None:
        """Free what the runner holds (the engine's `close`); `execute` raises after it.
        Idempotent."""
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed (Engine.close()): build a new Engine to run more")


def build_model(config: EngineConfig):
    """The engine's decoder for `config.model`: a tiny preset with seeded weights, a tiny
    checkpoint from `preempt lm train`, or a Llama/Qwen2 checkpoint directory (`hf`)."""
    from preempt.model.tiny import TinyLM, get_preset, resolve_dtype

    dtype = resolve_dtype(config.model.dtype)
    if config.model.backend == "hf":
        from preempt.model.hf import load_hf_model

        return load_hf_model(config.model.checkpoint, dtype=dtype)
    if config.model.checkpoint:
        from preempt.model.checkpoint import load_tiny_lm

        return load_tiny_lm(config.model.checkpoint, dtype=dtype)
    return TinyLM(get_preset(config.model.preset), seed=config.seed, dtype=dtype)


class TinyModelRunner(ModelRunner):
    """Real compute with the `tiny` (or `hf`) backend on a paged KV cache."""

    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int) -> None:
        import torch

        from preempt.kv.kv_cache import KVCache

        if config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)  # process-wide: asked for explicitly
        self.seed = config.seed
        self.block_size = block_size
        self.model = build_model(config)
        cfg, dtype = self.model.cfg, self.model.dtype
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.vocab_size = cfg.vocab_size
        self.kv_bytes_per_token = self.kv_cache.bytes_per_token

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | Sample | None]:
        if not chunks:
            return []
        sample_rows = [  # chunks that end at the last known token
            i for i, chunk in enumerate(chunks) if _chunk_bounds(chunk)[1] == chunk.request.num_tokens
        ]
        return self._sample(chunks, self.compute_logits(chunks), sample_rows)

    def compute_logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks (writing their KV) -> logits (B, V) at each chunk's last new
        token, whether or not it ends the request's known tokens (quality benchmarks read
        distributions, not only samples)."""
        import torch

        from preempt.model.attention import build_attention_metadata, with_masked_prefixes

        self._check_open()  # execute's too
        starts: list[int] = []
        num_new: list[int] = []
        token_ids: list[int] = []
        for chunk in chunks:
            start, end = _chunk_bounds(chunk)
            starts.append(start)
            num_new.append(end - start)
            token_ids.extend(chunk.request.token_ids(start, end))
        meta = build_attention_metadata(
            starts,
            num_new,
            [chunk.request.block_ids for chunk in chunks],
            self.block_size,
            kv_bytes_per_token_per_layer=self.kv_cache.bytes_per_token_per_layer,
        )
        cfg = self.model.cfg
        meta = with_masked_prefixes(
            meta, [chunk.request.kv_masked_until for chunk in chunks], cfg.num_layers, cfg.num_kv_heads
        )
        with torch.inference_mode():
            input_ids = torch.tensor(token_ids, dtype=torch.int64)  # (T,)
            return self.model(input_ids, meta.positions, self.kv_cache.layers, meta)  # (B, V)

    def close(self) -> None:
        """Free the KV cache and the model's weights (the model may be a multi-GB checkpoint)."""
        if not self.closed:
            self.kv_cache.close()
            self.model = None
        super().close()

    def _sample(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, rows: list[int]
    ) -> list[int | Sample | None]:
        out: list[int | Sample | None] = [None] * len(chunks)
        if not rows:
            return out
        greedy_rows = [i for i in rows if chunks[i].request.temperature == 0]
        if greedy_rows:
            # One argmax for all greedy rows instead of one call per request.
            tokens = logits[greedy_rows].argmax(dim=-1).tolist()
            for i, token in zip(greedy_rows, tokens, strict=True):
                out[i] = token
        for i in rows:
            request = chunks[i].request
            params = request.sampling
            if params is not None and not params.is_plain:
                out[i] = self._sample_with(params, request, logits[i])
            elif request.temperature != 0:
                seed = token_seed(self.seed, request.request_id, request.num_tokens)
                out[i] = sample_token(logits[i], request.temperature, seed)
        return out

    def _sample_with(self, params: SamplingParams, request: Request, logits: torch.Tensor) -> int | Sample:
        """A request's own sampling parameters (preempt.engine.sampling): penalties, bias,
        top-k/p, its seed, logprobs. Per row: such requests are rare next to plain ones."""
        processed = logits
        if params.changes_logits:
            processed = process_logits(
                logits, params, request.prompt_token_ids.tolist(), request.output_token_ids
            )
        if params.seed is None:
            seed = token_seed(self.seed, request.request_id, request.num_tokens)
        else:  # the request's own seed: the same tokens whatever id or batch it gets
            seed = token_seed(params.seed, 0, request.num_tokens)
        token = sample_token(processed, params.temperature, seed, params.top_p, params.top_k)
        if params.num_logprobs is None:
            return token
        return logprobs_of(logits, token, params.num_logprobs)


class NullModelRunner(ModelRunner):
    """No model, no KV: a deterministic placeholder token per (seed, request, position), for
    scheduling studies at full trace scale."""

    def __init__(
        self, config: EngineConfig, num_blocks: int = 0, block_size: int = 0, vocab_size: int = 256
    ) -> None:
        self.seed = config.seed
        self.vocab_size = vocab_size
        self.kv_bytes_per_token = 0

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | None]:
        self._check_open()
        out: list[int | None] = []
        for chunk in chunks:
            _, end = _chunk_bounds(chunk)
            request = chunk.request
            if end == request.num_tokens:
                out.append(token_seed(self.seed, request.request_id, end) % self.vocab_size)
            else:
                out.append(None)
        return out

    def decode_tokens(self, requests: Sequence[Request], num_steps: int) -> list[list[int]]:
        """The tokens `execute` would return for `num_steps` consecutive one-token decode
        steps of each request (the engine's decode runs): positions num_tokens ..
        num_tokens + num_steps - 1, drawn in one pass."""
        self._check_open()
        ids = [r.request_id for r in requests]
        seeds = token_seeds(self.seed, ids, [r.num_tokens for r in requests], num_steps)
        return (seeds % self.vocab_size).tolist()


def create_model_runner(config: EngineConfig, num_blocks: int, block_size: int) -> ModelRunner:
    """The runner of `config.model.backend`."""
    backend = config.model.backend
    if backend in ("tiny", "hf"):
        return TinyModelRunner(config, num_blocks, block_size)
    if backend == "null":
        return NullModelRunner(config, num_blocks, block_size)
    raise ValueError(f"config key 'model.backend': unknown backend '{backend}'; valid: tiny, null, hf")
