"""`preempt bench lengths`: how well each remaining-output estimator (`preemption.remaining`,
preempt.engine.remaining) knows what a running request still has
to make, on minutes of the trace it was not fitted on.

Protocol: for each held-out minute (the `lengths` sweep's fifteen, preempt/configs/
lengths.yaml; the first three with --quick), the learned model is fitted exactly as a run
fits it (LengthModel.from_trace: the trace's records outside that minute, max_tokens as
clients send it: a 1024 cap). Every request of the minute is then asked at the points of
its life a scheduler asks about it: before its first token and after each 32 tokens it
makes. The error of an estimate is |estimate - tokens it really had left|. Reported per
estimator: the mean absolute error over the minute's (request, point) pairs, with a 95%
interval over the minutes, and the learned model's error as a share of the cap's,
paired by minute. The oracle's error is 0 by definition and is not listed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from preempt.core.config import WorkloadConfig
from preempt.core.workload import build_workload
from preempt.engine.lengths import LengthModel
from preempt.obs.stats import t_interval

EVERY_TOKENS = 32  # a request is asked again after this many tokens
CAP = 1024


def held_out_minutes() -> list[float]:
    """The `lengths` sweep's minutes (its `replicate: workload.start_s`), one home."""
    from preempt.core.config_files import find_config_file

    spec = yaml.safe_load(Path(find_config_file("lengths.yaml")).read_text())
    return [float(s) for s in spec["replicate"]["workload.start_s"]]


def _errors(model: LengthModel, workload: WorkloadConfig, seed: int) -> dict[str, float]:
    cap_err, learned_err = [], []
    for request in build_workload(workload, seed):
        truth = request.output_limit
        for made in range(0, truth, EVERY_TOKENS):
            left = truth - made
            cap_err.append(abs((request.max_tokens - made) - left))
            estimate = model.expected_output_left(request.num_prompt_tokens, request.max_tokens, made)
            learned_err.append(abs(estimate - left))
    return {
        "max_tokens": float(np.mean(cap_err)),
        "learned": float(np.mean(learned_err)),
        "points": len(cap_err),
    }


def bench_lengths(quick: bool = False, trace: str = "azure-conv") -> dict[str, Any]:
    minutes = held_out_minutes()[: 3 if quick else None]
    base = WorkloadConfig(trace=trace, duration_s=60.0, max_tokens_mode="fixed", max_tokens_fixed=CAP)
    per_minute = []
    for seed, start in enumerate(minutes):
        workload = base.model_copy(update={"start_s": start})
        model = LengthModel.from_trace(workload, seed, (start, start + 60.0))
        per_minute.append({"start_s": start, **_errors(model, workload, seed)})
    share = t_interval([m["learned"] / m["max_tokens"] for m in per_minute], bounds=(0.0, math.inf))
    return {
        "trace": trace,
        "max_tokens": f"fixed cap {CAP}",
        "asked_every_tokens": EVERY_TOKENS,
        "minutes": per_minute,
        "mae_tokens": {
            name: t_interval([m[name] for m in per_minute], bounds=(0.0, math.inf))._asdict()
            for name in ("max_tokens", "learned")
        },
        "learned_over_max_tokens": share._asdict(),
    }


def render_lengths(result: dict[str, Any]) -> str:
    """The bench as a markdown table."""
    mae = result["mae_tokens"]
    share = result["learned_over_max_tokens"]

    def iv(d: dict[str, float], digits: int = 3) -> str:
        return f"{d['mean']:.{digits}g} [{d['lo']:.{digits}g}, {d['hi']:.{digits}g}]"

    lines = [
        f"Remaining-output estimates on {len(result['minutes'])} held-out minutes of {result['trace']} "
        f"(max_tokens: {result['max_tokens']}; each request asked before its first token and every "
        f"{result['asked_every_tokens']} tokens after; mean [95% interval over minutes]):",
        "",
        "| estimator | MAE, tokens | vs max_tokens |",
        "| --- | ---: | ---: |",
        f"| max_tokens (what the server is told) | {iv(mae['max_tokens'])} | 1 |",
        f"| learned (preempt.engine.lengths) | {iv(mae['learned'])} | {iv(share)} |",
        "| oracle | 0 | 0 |",
    ]
    return "\n".join(lines)
