"""`preempt bench engine`: scheduler overhead per step, trace replay speed, and where a
replay's step spends its time (phases)."""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from preempt.core.config import build_config
from preempt.core.request import Request
from preempt.engine.engine import Engine
from preempt.engine.view import StepOutput

# A replay's phases, in step order. The components are timed by wrapping them from outside
# (`_PhaseTimer`), so the engine's own step carries no timers. `step_other` is the step's
# own bookkeeping (the clock's advance, the output, the timers of the calls inside it),
# `loop_other` the replay loop's outside the step (its conditions, idle waits); a hook
# the config does not have is 0.
PHASES = (
    "arrivals",  # Engine.add_request: queueing the trace's arrivals
    "decode_runs",  # Engine._decode_run: runs of plain decode steps, and the checks for one
    "schedule",  # Scheduler.schedule (every call, the async-restore retries included)
    "stall",  # Engine._stall: the KV moves' wait (no work without a saver)
    "step_shape",  # Engine._step_shape: the batch's shape for the cost model
    "execute",  # the model runner
    "cost_model",  # CostModel.step_time_s: the step's duration on the virtual clock
    "update_from_output",  # Scheduler.update_from_output
    "prefetcher",  # restore prefetch hook
    "early_saver",  # early-save hook (its policy, features, lookahead forks)
    "on_step",  # the replay's step hook (e.g. the collect feature logger)
    "step_other",
    "loop_other",
)
_INSIDE_STEP = PHASES[PHASES.index("schedule") : PHASES.index("early_saver") + 1]


class _PhaseTimer:
    """Times `engine.run`'s phases by replacing the engine's components with `_Timed`
    wrappers (instance attributes shadow the methods the step calls). A timed call
    inside another (a lookahead fork's steps inside the early saver) counts only in the
    outer phase, so the phases never overlap."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = dict.fromkeys((*PHASES, "step"), 0.0)
        self.depth = 0  # timed phase calls in progress
        timed = {
            (engine, "add_request"): "arrivals",
            (engine, "_decode_run"): "decode_runs",
            (engine, "step"): "step",
            (engine.scheduler, "schedule"): "schedule",
            (engine, "_stall"): "stall",
            (engine, "_step_shape"): "step_shape",
            (engine.runner, "execute"): "execute",
            (engine.cost_model, "step_time_s"): "cost_model",
            (engine.scheduler, "update_from_output"): "update_from_output",
            (engine, "prefetcher"): "prefetcher",
            (engine, "early_saver"): "early_saver",
        }
        for (owner, name), phase in timed.items():
            inner = getattr(owner, name)
            if inner is not None:
                setattr(owner, name, _Timed(inner, self, phase))

    def on_step(self, hook: Callable[..., Any] | None) -> Callable[..., Any] | None:
        return None if hook is None else _Timed(hook, self, "on_step")

    def phases(self, total_s: float, num_steps: int) -> dict[str, Any]:
        """Seconds and microseconds per (batch-running) step of each phase, decode runs'
        steps included; they sum to `total_s`, the instrumented `run`'s wall time."""
        seconds = dict(self.seconds)
        step_s = seconds.pop("step")
        seconds["step_other"] = step_s - sum(seconds[p] for p in _INSIDE_STEP)
        outside = seconds["arrivals"] + seconds["decode_runs"] + seconds["on_step"]
        seconds["loop_other"] = total_s - step_s - outside
        return {
            "total_s": round(total_s, 3),
            "num_steps": num_steps,  # steps that ran a batch
            "s": {p: round(seconds[p], 3) for p in PHASES},
            "us_per_step": {p: round(1e6 * seconds[p] / max(num_steps, 1), 2) for p in PHASES},
        }


class _Timed:
    """A callable that adds its calls' wall time to its phase (the step's to "step", which
    holds the phases inside it); other attributes are the wrapped object's (a hook's
    `stats()`, `policy`). A lookahead fork (a deep copy of the engine) copies it and its
    timer, or shares it where the fork shares the component (the cost model): either way
    the fork's calls run inside the early saver's, which alone counts them."""

    def __init__(self, inner: Callable[..., Any], timer: _PhaseTimer, phase: str) -> None:
        self._inner = inner
        self._timer = timer
        self._phase = phase

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        timer = self._timer
        if self._phase == "step":
            started = time.perf_counter()
            result = self._inner(*args, **kwargs)
            timer.seconds["step"] += time.perf_counter() - started
            return result
        if timer.depth:  # inside another phase: that one counts it
            return self._inner(*args, **kwargs)
        timer.depth += 1
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            timer.seconds[self._phase] += time.perf_counter() - started
            timer.depth -= 1

    def __getattr__(self, name: str) -> Any:
        # Private and special names are never delegated: copy and pickle probe a bare
        # instance (no `_inner` yet) for them.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def replay_phases(
    overrides: dict[str, Any], on_step: Callable[[StepOutput], None] | None = None
) -> dict[str, Any]:
    """One replay of `overrides`'s workload (with `on_step`, if given, as `Engine.run`'s
    hook, which turns the engine's decode runs off) with every phase timed: slower than a
    plain replay by the timers' own cost (compare `total_s` with `_replay_speed`'s
    `wall_s`). Steps taken in decode runs count in `decode_runs`, not in the step's phases."""
    from preempt.core.workload import build_workload

    config = build_config(overrides)
    requests = build_workload(config.workload, seed=config.seed)
    engine = Engine(config)
    timer = _PhaseTimer(engine)
    started = time.perf_counter()
    engine.run(requests, on_step=timer.on_step(on_step))
    total_s = time.perf_counter() - started
    # The replay's outcome beside its timing: the timers must change no decision.
    return {"sim_time_s": round(engine.clock.now(), 3), **timer.phases(total_s, engine.num_steps)}


def _replay_speed(overrides: dict[str, Any], repeats: int = 1) -> dict[str, Any]:
    """One replay of `overrides`'s workload, timed (the best of `repeats` replays, each
    from a collected heap: the least noisy reading of a busy machine's times, as
    `timeit` advises; `wall_s_each` lists them all)."""
    from preempt.core.workload import build_workload

    config = build_config(overrides)
    walls = []
    for _ in range(repeats):
        requests = build_workload(config.workload, seed=config.seed)
        engine = Engine(config)
        gc.collect()
        started = time.perf_counter()
        engine.run(requests)
        walls.append(time.perf_counter() - started)
    wall_s = min(walls)
    extra = {"wall_s_each": [round(wall, 3) for wall in walls]} if repeats > 1 else {}
    return {
        "num_requests": len(requests),
        "num_steps": engine.num_steps,
        "sim_time_s": round(engine.clock.now(), 3),
        "wall_s": round(wall_s, 3),
        "sim_requests_per_wall_s": round(len(requests) / wall_s, 1),
        "sim_s_per_wall_s": round(engine.clock.now() / wall_s, 3),
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_steps_in_decode_runs": engine.num_decode_run_steps,
        **extra,
    }


def decoding_engine(num_running: int, num_waiting: int) -> Engine:
    """A `null` engine with `num_running` requests decoding (64-1023 token prompts, seeded)
    and `num_waiting` queued behind them: the state the per-step benchmarks time."""
    config = build_config(
        {
            "model": {"backend": "null"},
            "scheduler": {"max_num_seqs": num_running, "max_num_batched_tokens": 8192},
        }
    )
    engine = Engine(config)
    rng = np.random.default_rng(0)
    for index in range(num_running + num_waiting):
        engine.add_request(
            Request(
                request_id=index,
                arrival_s=0.0,
                prompt_token_ids=rng.integers(32, 127, size=int(rng.integers(64, 1024)), dtype=np.int32),
                max_tokens=10_000,
                target_output_tokens=10_000,
            )
        )
    while len(engine.scheduler.running) < num_running or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # admit and prefill until every running request decodes
    return engine


def _scheduler_overhead(num_running: int, num_waiting: int, num_steps: int) -> dict[str, Any]:
    """Per-step cost of scheduling with `num_running` decoding and `num_waiting` queued
    requests (null backend, so only engine + scheduler work is timed)."""
    engine = decoding_engine(num_running, num_waiting)
    schedule_s, step_s = [], []
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.scheduler.schedule()
        schedule_s.append(time.perf_counter() - started)
    # schedule() without execution is idempotent here (blocks already cover the next
    # token, the batch is full); full steps add the engine's bookkeeping on top.
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - started)
    assert len(engine.scheduler.running) == num_running and engine.scheduler.num_waiting == num_waiting
    return {
        "num_running": num_running,
        "num_waiting": num_waiting,
        "schedule_ms_median": round(1e3 * statistics.median(schedule_s), 4),
        "engine_step_ms_median": round(1e3 * statistics.median(step_s), 4),
        "target_ms": 1.0,
    }


# Where the comparisons live: the azure-conv trace at 4x its rate on a 2,000-block pool
# (the virtual H200 clock serving Llama-3-8B, null backend, 128 seats, clients' max_tokens
# cap), so the pool runs out, requests wait and the policies preempt: 10 minutes of the
# trace hold 2,867 requests and about 31,600 steps. Each standard policy replays it.
PRESSURED = {
    "model": {"backend": "null", "max_model_len": 16384},
    "cache": {"block_size": 16, "num_blocks": 2000},
    "clock": {"kind": "virtual", "target": "h200-llama3-8b"},
    "workload": {
        "trace": "azure-conv",
        "rate_scale": 4.0,
        "sla_mix": {0: 0.7, 1: 0.2, 2: 0.1},
        "max_tokens_mode": "fixed",
        "max_tokens_fixed": 1024,
    },
    "preemption": {"priority_weights": {"age": 0.05, "sla": 0.8, "tokens": 0.5}},
}
STANDARD_POLICIES = ("vllm_fcfs", "vllm_priority", "priority_score", "fastserve_mlfq", "srpt")


def pressured_replays(minutes: int, repeats: int = 1) -> dict[str, Any]:
    """Each standard policy on `minutes` of the pressured workload (`PRESSURED`): its
    replay speed (the best of `repeats`) and `real_time_factor`, the trace's seconds
    replayed per wall second."""
    out = {}
    for policy in STANDARD_POLICIES:
        overrides = json.loads(json.dumps(PRESSURED))
        overrides["workload"]["duration_s"] = 60 * minutes
        overrides["scheduler"] = {"policy": policy}
        result = _replay_speed(overrides, repeats)
        result["us_per_step"] = round(1e6 * result["wall_s"] / result["num_steps"], 1)
        result["real_time_factor"] = round(60 * minutes / result["wall_s"], 1)
        out[policy] = result
    return out


def bench_engine(quick: bool = False) -> dict[str, Any]:
    minutes = 1 if quick else 10
    tiny = _replay_speed({"workload": {"trace": "azure-conv", "duration_s": 60 * minutes}})
    null_slice = _replay_speed(
        {"model": {"backend": "null"}, "workload": {"trace": "azure-conv", "duration_s": 60 * minutes}}
    )
    result: dict[str, Any] = {
        "bench": "engine",
        "scheduler_overhead": _scheduler_overhead(256, 2000, 20 if quick else 200),
        f"replay_azure_conv_{minutes}min_tiny": tiny,
        f"replay_azure_conv_{minutes}min_null": null_slice,
        "tiny_vs_null_wall_ratio": round(tiny["wall_s"] / null_slice["wall_s"], 2),
        f"pressured_azure_conv_{minutes}min_4x": pressured_replays(minutes, repeats=1 if quick else 3),
    }
    if quick:
        null_slice["phases"] = replay_phases(
            {"model": {"backend": "null"}, "workload": {"trace": "azure-conv", "duration_s": 60 * minutes}}
        )
    else:
        hour = {"model": {"backend": "null"}, "workload": {"trace": "azure-conv"}}
        result["replay_azure_conv_full_hour_null"] = _replay_speed(hour)
        result["replay_azure_conv_full_hour_null"]["phases"] = replay_phases(hour)
    return result
