"""`preempt bench engine`: scheduler overhead per step and trace replay speed."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from preempt.core.config import build_config
from preempt.core.request import Request
from preempt.engine.engine import Engine


def _replay_speed(overrides: dict[str, Any]) -> dict[str, Any]:
    from preempt.core.workload import build_workload

    config = build_config(overrides)
    requests = build_workload(config.workload, seed=config.seed)
    engine = Engine(config)
    started = time.perf_counter()
    engine.run(requests)
    wall_s = time.perf_counter() - started
    return {
        "num_requests": len(requests),
        "num_steps": engine.num_steps,
        "sim_time_s": round(engine.clock.now(), 3),
        "wall_s": round(wall_s, 3),
        "sim_requests_per_wall_s": round(len(requests) / wall_s, 1),
        "sim_s_per_wall_s": round(engine.clock.now() / wall_s, 3),
        "num_preemptions": engine.scheduler.num_preemptions,
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
    }
    if not quick:
        result["replay_azure_conv_full_hour_null"] = _replay_speed(
            {"model": {"backend": "null"}, "workload": {"trace": "azure-conv"}}
        )
    return result
