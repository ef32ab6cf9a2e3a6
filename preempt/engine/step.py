"""What one engine step returns, and the engine as its step hooks see it.

Owns: `StepOutput` (the scheduler's output, the requests that finished, the step's
compute and stall time) and `EngineView`, the part of `preempt.engine.engine.Engine`
that the hooks run after a step read: early saves, the restore prefetcher, the feature
computation, the lookahead oracle. The hooks name this interface instead of the
`Engine` class, so that the engine can build them without an import circle (the engine
imports its hooks; they import only this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from preempt.core.block_pool import BlockPool
    from preempt.core.clock import Clock
    from preempt.core.config import EngineConfig
    from preempt.core.request import Request
    from preempt.engine.scheduler import Scheduler, SchedulerOutput
    from preempt.kv.saver import Saver


class StepOutput(NamedTuple):
    scheduled: SchedulerOutput
    finished: list[Request]
    step_s: float  # this step's compute duration on the engine's clock
    stall_s: float = 0.0  # compute waited this long for KV moves before the step


class EngineView(Protocol):
    """The engine after a step, as a hook reads it. A hook changes only what it owns:
    the saves it asks the saver for, the blocks a prefetch holds for its request."""

    config: EngineConfig
    scheduler: Scheduler
    block_pool: BlockPool
    block_size: int
    saver: Saver | None
    clock: Clock
    num_steps: int

    def upcoming_arrivals(self, until_s: float) -> list[Request]:
        """`Engine.run`'s requests arriving by `until_s`, not added yet."""

    def fork(self) -> EngineView:
        """A copy that can be stepped without touching this engine (the lookahead's)."""

    def add_request(self, request: Request) -> None: ...

    def step(self) -> StepOutput: ...
