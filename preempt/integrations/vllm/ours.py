"""preempt's own engine on a parity workload under the plugin's policy, with its clock.

The engine (null backend, virtual clock) runs the workload as `preempt.parity.ours` does,
but stamps each request's arrival with the engine's clock at the step it arrives (ages
in the priority score are seconds, not step numbers) and records every step's start time and
charged duration. The vLLM plugin then replays exactly that clock (`ReplayClock`), so
both sides decide with the same `now` at every step: any difference is a rule, not time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from preempt.core.config import EngineConfig
from preempt.parity.ours import engine_config, step_trace, workload_request
from preempt.parity.workload import ParityWorkload


class TimedTrace(NamedTuple):
    trace: list[dict]  # the parity trace format (preempt.parity.compare)
    starts_s: list[float]  # step k's `now`
    durations_s: list[float]  # what step k charged to time slices


def plugin_engine_config(
    workload: ParityWorkload, policy: str, preemption: dict, overrides: Sequence[str] = ()
) -> EngineConfig:
    """The parity settings with preempt's `policy` and `preemption` section (recompute)."""
    sets = [f"scheduler.policy={policy}", "preemption.mode=recompute"]
    sets += [f"preemption.{key}={_yaml(value)}" for key, value in preemption.items() if key != "mode"]
    return engine_config(workload, "fcfs", [*sets, *overrides])


def _yaml(value: object) -> str:
    import json

    return json.dumps(value)  # JSON is YAML: nested sections survive --set parsing


def run_ours_timed(workload: ParityWorkload, config: EngineConfig) -> TimedTrace:
    from preempt.engine.engine import Engine

    engine = Engine(config)
    pending = sorted(workload.requests, key=lambda r: (r.arrival_step, r.id))
    trace: list[dict] = []
    starts: list[float] = []
    durations: list[float] = []
    next_index = 0
    try:
        while next_index < len(pending) or engine.scheduler.has_unfinished:
            step = len(trace)
            now = engine.clock.now()
            while next_index < len(pending) and pending[next_index].arrival_step <= step:
                spec = pending[next_index]
                next_index += 1
                engine.add_request(workload_request(spec, now))
            output = engine.step()
            starts.append(now)
            durations.append(output.step_s)
            if not output.scheduled.chunks and engine.scheduler.backoff_until_s > engine.clock.now():
                # Nothing ran because the admission backoff holds: idle until it ends, as
                # Engine.run does (an empty step takes no time on the virtual clock).
                engine.clock.wait_until(engine.scheduler.backoff_until_s)
            trace.append(step_trace(output))
    finally:
        engine.close()
    return TimedTrace(trace, starts, durations)
