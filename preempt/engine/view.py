"""What one engine step returns, and the engine as its step hooks see it.

Owns: `StepOutput` (the scheduler's output, the requests that finished, the step's
compute and stall time), `EngineView`, the read-only view of the engine after a step
that its observers get instead of the `Engine` (early saves, the restore prefetcher, the
feature computation, the lookahead oracle, the metrics, the collect logger), and `Fork`,
what the lookahead drives of the engine copy it forks.

The view reads; it changes nothing, except through its few narrow actions, each owned by
the one hook that asks: `early_save` / `discard_early` (early saves), `predecode` /
`prefetch` / `cancel_prefetch` (the prefetcher: the blocks it holds for a request are
that request's own) and `fork` (a copy; the live engine is untouched). Reads return
copies or immutable values, so a hook cannot reorder the scheduler's queues.

The hooks name these types instead of the `Engine` class, so that the engine can build
them without an import circle (the engine imports its hooks; they import only this
module).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from preempt.core.block_pool import blocks_needed
from preempt.core.cost_model import step_shape

if TYPE_CHECKING:
    from preempt.core.clock import Clock
    from preempt.core.config import EngineConfig
    from preempt.core.request import Request
    from preempt.engine.policies import SchedulingPolicy
    from preempt.engine.scheduler import Scheduler, SchedulerOutput
    from preempt.kv.record import PreemptionRecord


class StepOutput(NamedTuple):
    scheduled: SchedulerOutput
    finished: list[Request]
    step_s: float  # this step's compute duration on the engine's clock
    stall_s: float = 0.0  # compute waited this long for KV moves before the step


class Fork(Protocol):
    """A copy of the engine that the lookahead steps on its own (`EngineView.fork`)."""

    scheduler: Scheduler
    clock: Clock
    num_steps: int

    def add_request(self, request: Request) -> None: ...

    def step(self) -> StepOutput: ...


class EngineView:
    """The engine after a step, as a hook reads it (`Engine.view`: a new one per access,
    cheap; it keeps its engine alive, the engine keeps no view: no reference cycle)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine  # an `Engine`; reached only through the members below

    # ----------------------------------------------------------------- reads
    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def now(self) -> float:
        return self._engine.clock.now()

    @property
    def num_steps(self) -> int:
        return self._engine.num_steps

    @property
    def num_arrived(self) -> int:
        """Requests that have arrived by now: handed to the engine, or arrived during the
        last step and queued by the next (`upcoming_arrivals(now)`)."""
        return self._engine.num_added + len(self._engine.upcoming_arrivals(self.now))

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests in admission order (a snapshot)."""
        return tuple(self._engine.scheduler.running)

    @property
    def restoring(self) -> tuple[Request, ...]:
        """READY requests (async restores: admitted, out of the batch until their copy-in
        ends), in admission order (a snapshot)."""
        return tuple(self._engine.scheduler.restoring)

    @property
    def num_waiting(self) -> int:
        return self._engine.scheduler.num_waiting

    @property
    def num_paused(self) -> int:
        return len(self._engine.scheduler.paused)

    @property
    def backoff_until_s(self) -> float:
        return self._engine.scheduler.backoff_until_s

    @property
    def max_num_seqs(self) -> int:
        return self._engine.scheduler.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self._engine.scheduler.config.max_num_batched_tokens

    def waiting_scores(self, now: float) -> np.ndarray:
        """Priority scores of all waiting requests at `now` (`Scheduler.waiting_scores`)."""
        return self._engine.scheduler.waiting_scores(now)

    def next_to_admit(self, k: int) -> list[Request]:
        """The first `k` waiting requests in admission order."""
        return self._engine.scheduler.next_to_admit(k)

    @property
    def policy(self) -> SchedulingPolicy:
        """The scheduling policy (a decider: its methods read requests, change nothing)."""
        return self._engine.scheduler.policy

    def step_time_s(self, chunks: Iterable[tuple[int, int]]) -> float | None:
        """What a step running `chunks` ((tokens computed before, new tokens) per sequence)
        lasts on the virtual clock (the engine's cost model); None on the wall clock."""
        if self._engine.config.clock.kind != "virtual":
            return None
        return self._engine.cost_model.step_time_s(step_shape(chunks))

    @property
    def uses_failure_fallback(self) -> bool:
        """Whether the scheduler applies the PREEMPTION_FAILED fallback (config or policy)."""
        return self._engine.scheduler.uses_failure_fallback

    def preemptions_in_window(self, now: float) -> int:
        """Preemptions that count towards the rate cap in the minute before `now`."""
        return self._engine.scheduler.preemptions_in_window(now)

    @property
    def records(self) -> Sequence[PreemptionRecord]:
        """Every preemption decision so far (a read-only sequence; records are the
        scheduler's, never to be written through it)."""
        return _ReadOnly(self._engine.scheduler.records)

    @property
    def num_free_blocks(self) -> int:
        return self._engine.block_pool.num_free

    @property
    def num_blocks(self) -> int:
        return self._engine.block_pool.num_blocks

    @property
    def kv_usage(self) -> float:
        return self._engine.block_pool.usage

    @property
    def early_bytes_resolved(self) -> tuple[int, int]:
        """Early-copied raw bytes so far whose fate is known: (claimed by a preemption,
        wasted: freed unclaimed: the request finished or was aborted, or the copy was
        evicted, went stale or its preemption's save failed)."""
        early = self._engine.saver.early
        return early.early_bytes_used, early.early_bytes_wasted

    def stats(self) -> dict[str, float | int]:
        return self._engine.stats()

    def upcoming_arrivals(self, until_s: float) -> list[Request]:
        """`Engine.run`'s requests arriving by `until_s`, not added yet."""
        return self._engine.upcoming_arrivals(until_s)

    # ----------------------------------------------------------------- host copies (reads)
    def is_prefetched(self, request: Request) -> bool:
        return self._engine.saver.is_prefetched(request)

    def is_predecoded(self, request: Request) -> bool:
        return self._engine.saver.is_predecoded(request)

    def needs_decode(self, request: Request) -> bool:
        return self._engine.saver.needs_decode(request)

    def saved_bytes(self, request: Request) -> int:
        return self._engine.saver.saved_bytes(request)

    @property
    def prefetched_requests(self) -> list[Request]:
        return self._engine.saver.prefetched_requests

    @property
    def predecode_bytes_held(self) -> int:
        return self._engine.saver.ahead.predecode_bytes_held

    # ----------------------------------------------------------------- narrow actions
    def early_save(self, request: Request) -> bool:
        """Early saves: copy a running request's new full blocks to the host now."""
        return self._engine.saver.early_save(request, self.now)

    def discard_early(self, request: Request) -> None:
        """Early saves: the request finished; free its early copies."""
        self._engine.saver.discard_early(request)

    def predecode(self, request: Request) -> int:
        """Prefetch: start the host decode of a waiting request's copy; its decoded bytes."""
        return self._engine.saver.predecode(request, self.now)

    def prefetch(self, request: Request) -> int:
        """Prefetch: give a waiting request (KV on the host) the blocks that cover its
        computed tokens and start restoring into them; returns the blocks allocated."""
        engine = self._engine
        num_missing = blocks_needed(request.num_computed_tokens, engine.block_size) - len(request.block_ids)
        request.block_ids.extend(engine.block_pool.allocate(num_missing))
        engine.saver.prefetch(request, self.now)
        return num_missing

    def cancel_prefetch(self, request: Request) -> None:
        """Prefetch: drop a prefetched restore and free the request's blocks (its host
        copy stays)."""
        engine = self._engine
        engine.saver.cancel_prefetch(request)
        engine.block_pool.free(request.block_ids)
        request.block_ids = []

    def fork(self) -> Fork:
        """A copy that can be stepped without touching this engine (the lookahead's)."""
        return self._engine.fork()


class _ReadOnly(Sequence):
    """A list seen through `Sequence` only (no append, no item assignment)."""

    __slots__ = ("_items",)

    def __init__(self, items: list) -> None:
        self._items = items

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)
