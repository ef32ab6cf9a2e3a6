"""The engine loop: arrivals in, scheduled steps through the model, finished requests out.

Owns: wiring (config -> pool, scheduler, runner, clock, cost model), the step and the
replay loop. A step flows one way: `scheduler.schedule(now)` -> `runner.execute` -> the
clock advances -> one `scheduler.update_from_output` (tokens, timestamps, finished
requests) -> the hooks read the step. It decides nothing itself (the scheduler does) and
touches no tensor itself (the runner does).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from preempt.core.block_pool import BlockPool
from preempt.core.clock import make_clock
from preempt.core.config import ConfigError, EngineConfig
from preempt.core.cost_model import CostModel, StepShape, step_shape
from preempt.core.profiles import get_target
from preempt.core.registry import STEP_HOOKS
from preempt.core.request import Request, RequestState
from preempt.engine.decode_runs import RunSteps
from preempt.engine.policies import get_policy
from preempt.engine.remaining import make_estimator
from preempt.engine.scheduler import Scheduler, SchedulerOutput
from preempt.engine.view import EngineView, StepOutput


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        # The runner imports torch; keep that import out of `import preempt.engine.engine` users
        # that only want types (and out of the null backend's start-up where possible).
        from preempt.engine.model_runner import create_model_runner

        self.config = config
        self.cost_model = CostModel(get_target(config.clock.target))
        self.block_size = config.cache.block_size
        # A capacity from the target counts blocks as vLLM's `num_gpu_blocks`, of which it
        # keeps one as its null block; an explicit `cache.num_blocks` is the usable count.
        num_blocks = config.cache.num_blocks or self.cost_model.kv_capacity_blocks(self.block_size) - 1
        self.block_pool = BlockPool(num_blocks)
        self.runner = create_model_runner(config, num_blocks, self.block_size)
        self.saver = None
        if config.preemption.mode != "recompute":
            from preempt.kv.saver import Saver

            self.saver = Saver(
                config, getattr(self.runner, "kv_cache", None), self.cost_model, self.block_size
            )
        policy = get_policy(config.scheduler.policy, config.preemption)
        scheduler_cls = Scheduler
        if policy.loop == "sglang" and config.preemption.async_restore:
            raise ConfigError(
                "config key 'preemption.async_restore': the sglang_* policies' loop "
                "(preempt/engine/sglang_scheduler.py) restores synchronously"
            )
        if policy.loop == "sglang":
            from preempt.engine.sglang_scheduler import SglangScheduler as scheduler_cls
        self.scheduler = scheduler_cls(
            config.scheduler,
            policy,
            self.block_pool,
            self.block_size,
            preemption=config.preemption,
            mover=self.saver,
            remaining=make_estimator(config),
        )
        # The step's hooks (preempt.early, a layer up): built by name, called after each step.
        self.early_saver = None
        if config.early_save.policy != "none":
            self.early_saver = STEP_HOOKS.resolve("early_saver")(config.early_save)
        self.prefetcher = None
        if config.early_save.prefetch:
            self.prefetcher = STEP_HOOKS.resolve("prefetcher")(config.early_save)
        self.clock = make_clock(config.clock.kind)
        self.num_steps = 0
        self.num_added = 0  # requests handed to add_request (the forecast's news of arrivals)
        self.stall_s = 0.0  # compute waiting for KV moves (saves' copy-out, restores)
        self.stall_restore_s = 0.0  # the part that waited for restores only
        self._saver_thread_s_seen = 0.0
        # `run`'s arrivals not yet added (the lookahead oracle reads the future from them).
        self._pending: list[Request] = []
        self._next_pending = 0
        self.decode_runs = True  # `run` steps plain decode runs at once (`_decode_run`)
        self.num_decode_run_steps = 0  # of num_steps, those run so

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a request, or end it ABORTED at once when it can never run."""
        self.num_added += 1
        max_len = request.num_prompt_tokens + request.max_tokens
        if max_len > self.config.model.max_model_len:
            self._abort(
                request,
                f"prompt_too_long: prompt+max_tokens={max_len} > max_model_len="
                f"{self.config.model.max_model_len}",
            )
        elif (reason := self.scheduler.never_fits(request)) is not None:
            self._abort(request, f"exceeds_kv_capacity: {reason}")
        else:
            self.scheduler.add_request(request)

    def _abort(self, request: Request, reason: str) -> None:
        request.state = RequestState.ABORTED
        request.abort_reason = reason
        request.finish_s = self.clock.now()

    def abort_request(self, request: Request, reason: str) -> None:
        """Abort a queued or running request (client gone, shutdown); frees its blocks."""
        if not request.state.is_final:
            self.scheduler.finish_request(request, RequestState.ABORTED)
            if self.early_saver is not None:
                self.early_saver.policy.forget([request])
            self._abort(request, reason)

    def finish_request(self, request: Request) -> None:
        """End a request FINISHED before its limit (the server found a stop string)."""
        if not request.state.is_final:
            self.scheduler.finish_request(request, RequestState.FINISHED)
            if self.early_saver is not None:
                self.early_saver.policy.forget([request])
            request.finish_s = self.clock.now()

    # ----------------------------------------------------------------- step
    def step(self) -> StepOutput:
        scheduled = self.scheduler.schedule(self.clock.now())
        stall_s = self._stall(scheduled)
        while not scheduled.chunks and self.scheduler.restoring:
            # Async restores: nothing else can run, so compute does wait for the first READY
            # request's copy-in (a restore stall), then the step is scheduled again.
            wait_s = max(0.0, self.scheduler.restores.next_ready_s() - self.clock.now())
            self.clock.advance(wait_s)
            self.stall_s += wait_s
            self.stall_restore_s += wait_s
            again = self.scheduler.schedule(self.clock.now())
            stall_s += wait_s + self._stall(again)
            scheduled = again._replace(
                preempted=scheduled.preempted + again.preempted, records=scheduled.records + again.records
            )
        if not scheduled.chunks:
            return StepOutput(scheduled, [], 0.0, stall_s)
        shape = self._step_shape(scheduled)
        started = time.perf_counter()
        next_tokens = self.runner.execute(scheduled.chunks)
        compute_s = time.perf_counter() - started
        step_s = self.cost_model.step_time_s(shape) if self.config.clock.kind == "virtual" else compute_s
        self.clock.advance(step_s)
        self.num_steps += 1
        finished = self.scheduler.update_from_output(scheduled, step_s, next_tokens, self.clock.now())
        output = StepOutput(scheduled, finished, step_s, stall_s)
        # The prefetcher first: it takes free blocks for the next admissions' copy-ins, and
        # the early saver (the `lstm` policy's features, the lookahead forks) must read the
        # state the feature logger (an `on_step` hook, after the step) trains on.
        if self.prefetcher is not None:
            self.prefetcher(self.view, output)
        if self.early_saver is not None:
            self.early_saver(self.view, output)
        return output

    def fork(self) -> Engine:
        """A deep copy that can be stepped without touching this engine (the lookahead
        oracle's): no model compute, no early saver, no record history, no pending trace
        (add arrivals yourself). Virtual clock only: a fork cannot replay real time."""
        return _fork(self)

    def upcoming_arrivals(self, until_s: float) -> list[Request]:
        """`run`'s requests arriving by `until_s` that are not added yet (read-only: the
        lookahead oracle's knowledge of the trace's future)."""
        upcoming = []
        for request in itertools.islice(self._pending, self._next_pending, None):
            if request.arrival_s > until_s:
                break
            upcoming.append(request)
        return upcoming

    def _stall(self, scheduled: SchedulerOutput) -> float:
        """Compute waits for KV moves it depends on: on the virtual clock, until restores
        and (when the step uses blocks still being copied out) saves end; on the wall
        clock, the save/restore work the engine thread did inside schedule()."""
        if self.saver is None:
            return 0.0
        if self.config.clock.kind == "virtual":
            now = self.clock.now()
            restore_stall_s = max(0.0, self.saver.restore_end_s - now)
            until = max(self.saver.restore_end_s, scheduled.copy_out_wait_until_s)
            stall_s = max(0.0, until - now)
            self.stall_restore_s += restore_stall_s
            self.clock.advance(stall_s)
        else:  # the engine thread's share of this step's saves and restores
            stall_s = self.saver.engine_thread_s - self._saver_thread_s_seen
            self._saver_thread_s_seen = self.saver.engine_thread_s
        self.stall_s += stall_s
        return stall_s

    def close(self) -> None:
        """Stop background workers (the saver's threads on the wall clock) and free the
        engine's memory: the host pool's buffer, the KV cache, the model's weights.
        Idempotent; `stats()` and the records stay readable, stepping raises RuntimeError."""
        if self.saver is not None:
            self.saver.close()
            self.scheduler.settle_saves()  # the workers are done: every stored size is known
        self.runner.close()

    @property
    def closed(self) -> bool:
        return self.runner.closed

    @property
    def view(self) -> EngineView:
        """What the step hooks read: a new view each time (one small object). Not
        kept: a view held by its engine would be a reference cycle, and an engine dropped
        by its user would then keep its memory until the cyclic GC ran."""
        return EngineView(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> dict[str, float | int]:
        """Engine-level counters for summary.json and the server's metrics."""
        saver = self.saver
        return {
            "num_steps": self.num_steps,
            "num_blocks": self.block_pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_preemption_failed": self.scheduler.num_preemption_failed,
            "num_restore_fallbacks": self.scheduler.num_restore_fallbacks,
            "preemption_stall_s": self.stall_s,
            # Virtual clock: the stall split by cause. Saves' copy-out (what early saves
            # hide) is the rest; a restore is never hidden by an early save.
            "preemption_stall_restore_s": self.stall_restore_s,
            "preemption_stall_save_s": self.stall_s - self.stall_restore_s,
            **(saver.stats() if saver else {"kv_saved_bytes_raw": 0, "kv_saved_bytes_stored": 0}),
            **(self.early_saver.stats() if self.early_saver else {}),
            **(self.prefetcher.stats() if self.prefetcher else {}),
            **(self._async_restore_stats() if self.config.preemption.async_restore else {}),
        }

    def _async_restore_stats(self) -> dict[str, float | int]:
        """Async restores: how many waited out of the batch, and how long (the restore
        time the batch did not wait for, except where it had nothing else to run: that
        part is in `preemption_stall_restore_s` too)."""
        return {
            "num_async_restores": self.scheduler.restores.num_started,
            "preemption_restore_wait_s": self.scheduler.restores.wait_s,
        }

    @staticmethod
    def _step_shape(scheduled: SchedulerOutput) -> StepShape:
        return step_shape((request.num_computed_tokens, num_new) for request, num_new in scheduled.chunks)

    # ----------------------------------------------------------------- loops
    def run(
        self,
        requests: Sequence[Request],
        on_step: Callable[[StepOutput], None] | None = None,
        on_finished: Callable[[list[Request]], None] | None = None,
    ) -> list[Request]:
        """Replay requests (sorted by arrival) to completion; returns them, all final.
        `on_step` sees every step's output; `on_finished` only the requests that finish
        (after the step or decode run that finished them: a progress bar's hook, which
        keeps decode runs on)."""
        pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self._pending = pending
        next_index = 0
        while next_index < len(pending) or self.scheduler.has_unfinished:
            now = self.clock.now()
            while next_index < len(pending) and pending[next_index].arrival_s <= now:
                self.add_request(pending[next_index])
                next_index += 1
            self._next_pending = next_index
            if not self.scheduler.has_unfinished:
                if next_index < len(pending):
                    self.clock.wait_until(pending[next_index].arrival_s)
                continue
            if on_step is None:
                finished = self._decode_run()
                if finished is not None:
                    next_index = self._next_pending  # arrivals the run queued behind the head
                    if finished and on_finished is not None:
                        on_finished(finished)
                    continue
            output = self.step()
            if on_step is not None:
                on_step(output)
            if output.finished and on_finished is not None:
                on_finished(output.finished)
            if not output.scheduled.chunks and not output.scheduled.preempted:
                if self.scheduler.backoff_until_s > self.clock.now():
                    # Only new requests wait, and the backoff holds them: idle until it ends.
                    self.clock.wait_until(self.scheduler.backoff_until_s)
                    continue
                # Otherwise nothing can run although requests are queued: only possible if
                # the pool cannot hold the head request, which add_request already rejects.
                raise RuntimeError("scheduler made no progress with requests queued")
        return list(pending)

    def _decode_run(self) -> list[Request] | None:
        """Run the next steps at once if they are plain decodes (`Scheduler.decode_run`) up
        to the step the next arrival lands in that could change them (one that queues
        behind a waiting head that stays out cannot: `Scheduler.queues_behind_head`; the
        run queues it where it landed and goes on): their clock, tokens and block
        allocations exactly as single steps would make them, without a schedule and a step
        output per step. Returns the requests that finished; None (nothing run) where the
        next step must be decided on its own, and always with step hooks, on the wall
        clock, with a runner that computes real tokens, or while a restore is still
        running. Arrivals it queued move `_next_pending` on. `decode_runs = False` turns it
        off (tests compare the two)."""
        if not self.decode_runs or self.prefetcher is not None or self.early_saver is not None:
            return None
        if self.config.clock.kind != "virtual" or not hasattr(self.runner, "decode_tokens"):
            return None
        start_s = self.clock.now()
        if self.saver is not None and self.saver.restore_end_s > start_s:
            return None  # each step would stall for it
        run = self.scheduler.decode_run(start_s)
        if run is None:
            return None
        requests = run.requests
        num_seqs = len(requests)
        context = sum(request.num_computed_tokens for request in requests)
        now = start_s
        step_s: list[float] = []
        ends_s: list[float] = []
        joins: list[tuple[int, Request]] = []
        step_time_s = self.cost_model.decode_step_time_s
        pending, index = self._pending, self._next_pending
        for step in range(1, run.max_steps + 1):
            context += num_seqs  # one more token in each sequence's context
            seconds = step_time_s(num_seqs, context)
            now += seconds
            step_s.append(seconds)
            ends_s.append(now)
            if now >= run.until_s:
                break  # the backoff ends: the next step may admit the head
            # arrivals join before the next step: the run goes on past those that queue
            # behind the head, and ends with this step at any other
            landed = index < len(pending) and pending[index].arrival_s <= now
            while landed and self._queues_behind(pending[index]):
                joins.append((step, pending[index]))
                index += 1
                landed = index < len(pending) and pending[index].arrival_s <= now
            if landed:
                break
        allocations = self.scheduler.decode_run_allocations(run, len(step_s))
        tokens = self.runner.decode_tokens(requests, len(step_s))
        num_steps, joined, finished = self.scheduler.apply_decode_run(
            run, RunSteps(start_s, step_s, ends_s, tokens, allocations, joins)
        )
        # the run queued the arrivals before its last step (`add_request`'s checks were
        # `_queues_behind`'s); the loop queues the rest
        self.num_added += joined
        self._next_pending += joined
        if num_steps == 0:
            return None  # the policy decides in the first step
        for seconds in step_s[:num_steps]:
            self.clock.advance(seconds)
        self.num_steps += num_steps
        self.num_decode_run_steps += num_steps
        return finished

    def _queues_behind(self, request: Request) -> bool:
        """`request` would join the waiting queue behind its head during a decode run
        (`Scheduler.queues_behind_head`), not end ABORTED at once (`add_request`). The
        abort checks come first: `queues_behind_head` sets the request's estimate, which
        an aborted request never gets."""
        return (
            request.num_prompt_tokens + request.max_tokens <= self.config.model.max_model_len
            and self.scheduler.never_fits(request) is None
            and self.scheduler.queues_behind_head(request)
        )

    def generate(
        self,
        prompts: Iterable[Sequence[int] | str],
        max_tokens: int,
        temperature: float = 0.0,
    ) -> list[list[int]]:
        """Library use: run prompts (token ids or text, byte-level) to `max_tokens` each,
        all arriving now; returns the generated token ids in prompt order."""
        requests = []
        for index, prompt in enumerate(prompts):
            ids = list(prompt.encode("utf-8")) if isinstance(prompt, str) else list(prompt)
            requests.append(
                Request(
                    request_id=index,
                    arrival_s=self.clock.now(),
                    prompt_token_ids=np.asarray(ids, dtype=np.int32),
                    max_tokens=max_tokens,
                    target_output_tokens=max_tokens,
                    temperature=temperature,
                )
            )
        self.run(requests)
        return [r.output_token_ids for r in requests]


def _fork(engine: Engine) -> Engine:
    """`Engine.fork`. Each class copies itself (`__deepcopy__`: requests field by field,
    the block pool's lists shallowly, the KV store as a data-less model of itself, configs
    and the cost model shared); the engine only decides what a fork leaves behind."""
    from preempt.engine.model_runner import NullModelRunner

    if engine.config.clock.kind != "virtual":
        raise ValueError("the lookahead needs clock.kind 'virtual' (a fork cannot replay real time)")
    memo: dict[int, object] = {
        id(engine.runner): NullModelRunner(engine.config),  # no model compute
        id(engine.early_saver): None,
        id(engine.scheduler.records): [],  # no record history
        id(engine._pending): [],  # no pending trace
    }
    fork = copy.deepcopy(engine, memo)
    fork.num_steps = engine.num_steps
    return fork
