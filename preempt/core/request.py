"""A request's identity, its tokens and its lifecycle state.

Owns: the per-request facts the scheduler decides on and the runner acts on. Holds no
tensors and imports no torch. The *true* output length (from the trace) lives in
`target_output_tokens`; policies must only look at `max_tokens`, which is what a real
server would know (docs/design.md "Request states").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple

import numpy as np

# Where a preempted request's KV lives: kept on the device (`pause`), saved to the host
# pool, or None (dropped; recompute from tokens).
KVLocation = Literal["device", "host"] | None


class RequestState(str, enum.Enum):
    """Lifecycle states (the names are a contract: docs/design.md "Request states")."""

    WAITING = "WAITING"  # arrived, never admitted
    RUNNING = "RUNNING"  # holds device blocks and is in the batch
    # Taken out of the batch; KV kept, saved or dropped by mode. A preempted request stays
    # PREEMPTED in the waiting queue until it runs again, recompute victims included.
    PREEMPTED = "PREEMPTED"
    # Async restores only (`preemption.async_restore`): admitted, blocks and seat held, its
    # copy-in running; out of the batch until the copy ends. Otherwise unused: the
    # scheduler restores a request's KV in the step that readmits it.
    READY = "READY"
    PREEMPTION_FAILED = "PREEMPTION_FAILED"  # fallback: runs to completion, never preempted again
    FINISHED = "FINISHED"
    ABORTED = "ABORTED"

    @property
    def is_final(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(eq=False)
class Request:
    """One inference request. Identity is by object (eq=False), ids are for output."""

    request_id: int
    arrival_s: float
    prompt_token_ids: np.ndarray  # (P,) int32
    max_tokens: int  # the scheduler's budget for the output (what a server is told)
    target_output_tokens: int  # true output length from the trace; generation stops there
    sla_level: int = 0  # service class, higher = more important
    temperature: float = 0.0  # 0 = greedy
    # A client's sampling parameters (preempt.engine.sampling.SamplingParams: penalties, seed,
    # logprobs, stop token ids, min_tokens); None: plain `temperature` sampling.
    sampling: Any = None

    # --- runtime state, owned by the engine/scheduler ---
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the device cache
    block_ids: list[int] = field(default_factory=list)  # logical block i -> physical block
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    abort_reason: str | None = None
    stop_token_id: int | None = None  # the stop token that ended generation before its limit
    output_logprobs: list[Any] = field(default_factory=list)  # Sample per token, when asked for
    # --- preemption state ---
    slice_used_s: float = 0.0  # executed time since it last started running
    executed_s: float = 0.0  # executed time over its whole life (MLFQ's attained service)
    preemption_failed: bool = False  # fallback taken: never preempted for priority again
    kv_location: KVLocation = None  # where a PREEMPTED request's KV is
    # (num_layers, num_kv_heads) int: a lossy restore dropped these heads' saved KV, so their
    # keys below this position stay masked for the rest of the request's life (docs/design.md §9);
    # 0 where nothing is masked. None: no head dropped.
    kv_masked_until: Any = None
    # The scheduler's estimate of the output still to come (preempt.engine.remaining, set
    # when the request joins the queue and after each token); None: `max_tokens` is the
    # estimate (the output the client's cap still allows).
    expected_output_left: float | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"request {self.request_id}: max_tokens must be > 0, got {self.max_tokens}")
        if self.target_output_tokens <= 0:
            raise ValueError(
                f"request {self.request_id}: target_output_tokens must be > 0, "
                f"got {self.target_output_tokens}"
            )

    def __deepcopy__(self, memo: dict[int, object]) -> Request:
        """A copy that can be stepped apart from this one (an engine fork's): its own
        mutable lists, the rest shared. Shared safely: the prompt array (never written),
        `sampling` and the samples in `output_logprobs` (never mutated), `kv_masked_until`
        (replaced, never written in place: preempt.kv.saver). Field by field: deepcopy's
        generic walk over ~25 fields took ~17 us a request."""
        copied = object.__new__(Request)
        copied.__dict__.update(self.__dict__)
        copied.block_ids = list(self.block_ids)
        copied.output_token_ids = list(self.output_token_ids)
        copied.output_logprobs = list(self.output_logprobs)
        return copied

    @cached_property
    def num_prompt_tokens(self) -> int:
        # Cached (the prompt is never replaced): the scheduler and the runner read it for
        # every request in every step.
        return int(self.prompt_token_ids.shape[0])

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything whose KV the request needs."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def output_limit(self) -> int:
        """Generation stops at the trace's true length, or earlier at `max_tokens`."""
        return min(self.max_tokens, self.target_output_tokens)

    @property
    def is_finished_generating(self) -> bool:
        # Reached `output_limit`, spelled out (read after every generated token).
        num_output = len(self.output_token_ids)
        return (
            self.stop_token_id is not None
            or num_output >= self.max_tokens
            or num_output >= self.target_output_tokens
        )

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end)."""
        num_prompt = self.num_prompt_tokens
        out: list[int] = []
        if start < num_prompt:
            out.extend(self.prompt_token_ids[start : min(end, num_prompt)].tolist())
        if end > num_prompt:
            out.extend(self.output_token_ids[max(start, num_prompt) - num_prompt : end - num_prompt])
        return out


class ScheduledChunk(NamedTuple):
    """One request's share of a step: compute the KV of positions
    [request.num_computed_tokens, request.num_computed_tokens + num_new_tokens)."""

    request: Request
    num_new_tokens: int
