"""The `preempt` side of a parity run: the engine (null backend, virtual clock) stepped
through the same workload, step for step, recording what vLLM's driver records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from preempt.core.config import EngineConfig, build_config
from preempt.core.config_files import apply_override
from preempt.core.request import Request
from preempt.parity.workload import ParityRequest, ParityWorkload

if TYPE_CHECKING:
    from preempt.engine.view import StepOutput

POLICIES = {"fcfs": "vllm_fcfs", "priority": "vllm_priority", "lcf": "vllm_lcf"}


def engine_config(workload: ParityWorkload, policy: str, overrides: Sequence[str] = ()) -> EngineConfig:
    """The engine settings that mirror the workload's vLLM settings; `overrides` (`--set`)
    change our side only, e.g. to show what a difference does."""
    data = {
        "model": {"backend": "null", "max_model_len": workload.max_model_len},
        "cache": {"block_size": workload.block_size, "num_blocks": workload.usable_blocks},
        "scheduler": {
            "policy": POLICIES[policy],
            "max_num_seqs": workload.max_num_seqs,
            "max_num_batched_tokens": workload.max_num_batched_tokens,
        },
        "preemption": {"mode": "recompute"},
    }
    for assignment in overrides:
        apply_override(data, assignment)
    return build_config(data)


def workload_request(spec: ParityRequest, arrival_s: float) -> Request:
    """A workload request as the engine's `Request` (vLLM's priority is `-sla_level`)."""
    return Request(
        request_id=spec.id,
        arrival_s=arrival_s,
        prompt_token_ids=np.full(spec.prompt_tokens, 3, dtype=np.int32),
        max_tokens=spec.output_tokens,
        target_output_tokens=spec.output_tokens,
        sla_level=-spec.priority,
    )


def step_trace(output: StepOutput) -> dict:
    """One step in the parity trace format (preempt.parity.compare)."""
    return {
        # The step has already advanced num_computed_tokens by the chunk.
        "scheduled": {
            str(chunk.request.request_id): [
                chunk.request.num_computed_tokens - chunk.num_new_tokens,
                chunk.num_new_tokens,
            ]
            for chunk in output.scheduled.chunks
        },
        "preempted": [str(r.request_id) for r in output.scheduled.preempted],
        "finished": [str(r.request_id) for r in output.finished],
    }


def run_ours(workload: ParityWorkload, config: EngineConfig) -> list[dict]:
    """Per step: {"scheduled": {id: [start, num_tokens]}, "preempted": [id, ...] in
    order, "finished": [id, ...]}, ids as strings (the JSON both sides share)."""
    from preempt.engine.engine import Engine

    engine = Engine(config)
    pending = sorted(workload.requests, key=lambda r: (r.arrival_step, r.id))
    trace: list[dict] = []
    next_index = 0
    step = 0
    try:
        while next_index < len(pending) or engine.scheduler.has_unfinished:
            while next_index < len(pending) and pending[next_index].arrival_step <= step:
                spec = pending[next_index]
                next_index += 1
                engine.add_request(workload_request(spec, float(spec.arrival_step)))
            trace.append(step_trace(engine.step()))
            step += 1
    finally:
        engine.close()
    return trace
