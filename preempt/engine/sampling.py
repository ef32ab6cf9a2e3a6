"""Per-request sampling parameters and what they do to one row of logits.

Owns: `SamplingParams` (what an OpenAI client asks for: penalties, logit bias, top-k/p,
a seed, logprobs, min_tokens and stop token ids), the logits processing that applies
them (vLLM's semantics, listed on each function), the seeded draw, and `Sample`, the
token plus its logprobs that a runner hands back. Stop *strings* are text, so the server
matches them (`StopStringMatcher`); stop *token ids* end a request inside the engine
(`SamplingParams.stops_at`).

It must never look at other requests or at the engine: a token is a pure function of
(logits, params, the request's own tokens, a seed), so batching never changes it. The
params are plain Python (no torch) so `preempt.core.request` can hold them without torch;
only the functions that take logits import torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, request_id: int, position: int) -> int:
    """63-bit seed of the draw for the token at `position` of request `request_id`: three
    splitmix64 rounds, over the seed, the request id and the position."""
    return _splitmix64(_request_hash(seed, request_id) ^ (position & _MASK64)) >> 1


def token_seeds(seed: int, request_ids: Sequence[int], first: Sequence[int], count: int) -> np.ndarray:
    """`token_seed` for `count` consecutive positions of each request: (len(request_ids),
    count) uint64, row i holding positions first[i] .. first[i] + count - 1 of
    request_ids[i]. One numpy pass over a whole batch (the null backend's multi-step
    decode runs); the same values bit for bit (uint64 arithmetic wraps as the masks do)."""
    hashes = np.array([_request_hash(seed, r) for r in request_ids], dtype=np.uint64)
    positions = np.asarray(first, dtype=np.uint64)[:, None] + np.arange(count, dtype=np.uint64)
    x = hashes[:, None] ^ positions
    x += np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) >> np.uint64(1)


@functools.lru_cache(maxsize=1 << 16)
def _request_hash(seed: int, request_id: int) -> int:
    """The first two rounds, which depend on the request alone: memoized, since every
    token of a `null` replay is drawn here (they were ~20% of the hour's replay)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (request_id & _MASK64))


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; the defaults change nothing (greedy)."""

    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = all tokens."""
    seed: int | None = None
    """A request's own seed: its draws depend only on (seed, position), so the same
    request with the same seed gives the same tokens on any server run. None: the
    engine's seed and the request id."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_logprobs: int | None = None
    """None: no logprobs; k >= 0: the chosen token's logprob and the k most likely."""
    min_tokens: int = 0
    """Stop token ids cannot be sampled (nor end the request) before this many tokens."""
    stop_token_ids: frozenset[int] = frozenset()
    """Ids that end generation (the model's EOS ids unless ignore_eos, plus the request's
    `stop_token_ids`); the stop token itself is part of the output, as in vLLM."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.min_tokens < 0:
            raise ValueError("top_k and min_tokens must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def changes_logits(self) -> bool:
        """Whether `process_logits` does anything (the runner's fast path skips it)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or (self.min_tokens and self.stop_token_ids)
        )

    @property
    def is_plain(self) -> bool:
        """Greedy or plain temperature sampling, no logprobs: the runner's batched path."""
        return (
            not self.changes_logits
            and self.top_p == 1.0
            and self.top_k == 0
            and self.seed is None
            and self.num_logprobs is None
        )

    def stops_at(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether `token_id`, the request's `num_output_tokens`-th output token, ends it."""
        return token_id in self.stop_token_ids and num_output_tokens >= self.min_tokens


class Sample(NamedTuple):
    """A runner's answer for a request that asked for logprobs."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """A new (V,) float tensor: vLLM's order and semantics.

    - repetition penalty (CTRL): tokens seen in prompt or output get logit / p if > 0,
      logit * p if < 0;
    - frequency / presence penalties (OpenAI): minus f * count and minus p * [count > 0]
      over the *output* tokens only;
    - logit bias: added to the named ids;
    - min_tokens: stop token ids masked to -inf until min_tokens tokens exist.
    """
    import torch

    out = logits.to(torch.float64).clone()  # (V,)
    vocab_size = out.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        ids = [t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab_size]
        if ids:
            seen[torch.tensor(ids, dtype=torch.int64)] = True
        p = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / p, out * p), out)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab_size)
        counts = counts[:vocab_size].to(torch.float64)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float64)
    for token_id, bias in params.logit_bias:
        if 0 <= token_id < vocab_size:
            out[token_id] += bias
    if params.min_tokens and len(output_ids) < params.min_tokens:
        for token_id in params.stop_token_ids:
            if 0 <= token_id < vocab_size:
                out[token_id] = float("-inf")
    return out


def sample_token(
    logits: torch.Tensor, temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0
) -> int:
    """One token from logits (V,): argmax when temperature == 0, else a seeded
    inverse-CDF draw from softmax(logits / temperature), restricted to the top_k most
    likely tokens and to the smallest set whose mass reaches top_p."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)  # (V,)
    if top_k or top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        if top_p < 1.0:
            # Keep a token while the mass before it is below top_p: the most likely always stays.
            before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
            keep &= before < top_p
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered
    cdf = torch.cumsum(probs, dim=0)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    index = min(int(torch.searchsorted(cdf.cpu(), u, right=True)), logits.shape[0] - 1)
    while probs[index] == 0 and index > 0:  # u fell on a masked token's (empty) interval edge
        index -= 1
    return index


def logprobs_of(logits: torch.Tensor, token_id: int, k: int) -> Sample:
    """The chosen token's logprob and the k most likely, from the model's raw
    distribution (vLLM V1's default `raw_logprobs`: before penalties and temperature)."""
    import torch

    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # (V,)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logp, min(k, logp.shape[0]))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return Sample(token_id, float(logp[token_id]), top)


class StopStringMatcher:
    """Finds stop strings in streamed text, across chunk boundaries.

    `push(piece)` returns the text safe to emit now: it holds back everything from the
    earliest position where a stop string could begin that the next piece may complete
    (also when a shorter stop string already matched after that position: the longer one
    would come first). After a match, `is_stopped` is set, the text before the stop string
    is released and everything after it is dropped (OpenAI: the stop string is not part of
    the output). `close()` ends the text; `flush()` releases the held text without
    stopping.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.is_stopped = False
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        if self.is_stopped:
            return ""
        text = self._pending + piece
        first = self._first_match(text)
        # A stop string that starts before that match (or anywhere in the held tail) may
        # still be completed by the next piece: everything from its start waits.
        partial = self._first_partial(text)
        if first is not None and (partial is None or first[0] <= partial):
            self.is_stopped, self.matched, self._pending = True, first[1], ""
            return text[: first[0]]
        cut = len(text) if partial is None else partial
        self._pending = text[cut:]
        return text[:cut]

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The earliest complete stop string in `text` (ties: the first listed)."""
        first = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        return first

    def _first_partial(self, text: str) -> int | None:
        """The earliest position from which `text`'s tail is a proper prefix of a stop
        string (so the string is still incomplete), or None."""
        for at in range(max(0, len(text) - self._hold), len(text)):
            tail = text[at:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self.stops):
                return at
        return None

    def flush(self) -> str:
        """Release what is held back, stop strings in it included (for text that may not
        stop yet, e.g. before `min_tokens`)."""
        text, self._pending = self._pending, ""
        return "" if self.is_stopped else text

    def close(self) -> str:
        """The end of the text: no held prefix can complete any more, so a stop string in
        what was held back (behind a longer one that might have started earlier) cuts it."""
        text, self._pending = self._pending, ""
        if self.is_stopped:
            return ""
        first = self._first_match(text)
        if first is not None:
            self.is_stopped, self.matched = True, first[1]
            return text[: first[0]]
        return text
