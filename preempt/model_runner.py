"""Model runners: turn one step's scheduled chunks into KV writes and next tokens.

Owns: the step's input tensors and attention metadata, the model call, and sampling.
A runner must never mutate a request (the engine advances `num_computed_tokens` and
appends the returned tokens), never allocate or free blocks (it writes only into the
physical blocks `request.block_ids` names) and never decide what runs.

Sampling is a pure function of (logits, engine seed, request id, position): greedy when
`temperature == 0`, otherwise inverse-CDF sampling with a uniform drawn from a generator
seeded by (seed, request_id, position). A request's tokens therefore do not depend on
which other requests shared its steps, nor on how its prompt was chunked.

torch is imported only by the `tiny` runner, so the `null` backend starts without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from preempt.config import EngineConfig
from preempt.request import ScheduledChunk

if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, request_id: int, position: int) -> int:
    """63-bit seed of the draw for the token at `position` of request `request_id`."""
    h = 0
    for value in (seed, request_id, position):
        h = _splitmix64(h ^ (value & _MASK64))
    return h >> 1


def sample_token(logits: torch.Tensor, temperature: float, seed: int) -> int:
    """One token from logits (V,): argmax when temperature == 0, else a seeded draw from
    softmax(logits / temperature)."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)  # (V,)
    cdf = torch.cumsum(probs, dim=0)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf.cpu(), u, right=True)), logits.shape[0] - 1)


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
    (the last known token), else None. It does not modify the requests.
    """

    vocab_size: int
    kv_bytes_per_token: int  # K and V of one token over all layers; 0 when there is no KV

    @abstractmethod
    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | None]: ...


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

        from preempt.kv_cache import KVCache

        if config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)  # process-wide: asked for explicitly
        self.seed = config.seed
        self.block_size = block_size
        self.model = build_model(config)
        cfg, dtype = self.model.cfg, self.model.dtype
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.vocab_size = cfg.vocab_size
        self.kv_bytes_per_token = self.kv_cache.bytes_per_token

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | None]:
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

    def _sample(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, rows: list[int]
    ) -> list[int | None]:
        out: list[int | None] = [None] * len(chunks)
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
            if request.temperature != 0:
                seed = token_seed(self.seed, request.request_id, request.num_tokens)
                out[i] = sample_token(logits[i], request.temperature, seed)
        return out


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
        out: list[int | None] = []
        for chunk in chunks:
            _, end = _chunk_bounds(chunk)
            request = chunk.request
            if end == request.num_tokens:
                out.append(token_seed(self.seed, request.request_id, end) % self.vocab_size)
            else:
                out.append(None)
        return out


def create_model_runner(config: EngineConfig, num_blocks: int, block_size: int) -> ModelRunner:
    """The runner of `config.model.backend`."""
    backend = config.model.backend
    if backend in ("tiny", "hf"):
        return TinyModelRunner(config, num_blocks, block_size)
    if backend == "null":
        return NullModelRunner(config, num_blocks, block_size)
    raise ValueError(f"config key 'model.backend': unknown backend '{backend}'; valid: tiny, null, hf")
