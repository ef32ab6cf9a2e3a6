"""`preempt bench NAME`: benchmarks that print one JSON object.

Owns: the measurement protocols (what is timed, against which baseline measured in the
same run). Targets are checked here, never in timed tests: these machines are shared and
noisy, so tests check behaviour and benchmarks report numbers as ratios.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _engine(quick: bool) -> dict[str, Any]:
    from preempt.bench.engine import bench_engine

    return bench_engine(quick)


def _save(quick: bool) -> dict[str, Any]:
    from preempt.bench.save import bench_save

    return bench_save(quick)


def _serve(quick: bool) -> dict[str, Any]:
    from preempt.bench.serve import bench_serve

    return bench_serve(quick)


def _codec(
    quick: bool,
    model: str | None = None,
    plan: str | None = None,
    served_speed: bool = True,
    speed: bool = True,
    prompts: int | None = None,
) -> dict[str, Any]:
    from preempt.bench.codec import bench_codec

    return bench_codec(
        quick, model=model, plan=plan, served_speed=served_speed, speed=speed, num_prompts=prompts
    )


def _early(quick: bool, model: str | None = None) -> dict[str, Any]:
    from preempt.bench.early import bench_early

    return bench_early(quick, model=model)


def _predictor(quick: bool) -> dict[str, Any]:
    from preempt.bench.predictor import bench_predictor

    return bench_predictor(quick)


def _kernels(quick: bool) -> dict[str, Any]:
    from preempt.bench.kernels import bench_kernels

    return bench_kernels(quick)


def _clock(quick: bool, measured: str | None = None) -> dict[str, Any]:
    from preempt.bench.clock import bench_clock

    return bench_clock(quick, measured=measured)


def _vllm(quick: bool) -> dict[str, Any]:
    from preempt.bench.vllm import bench_vllm

    return bench_vllm(quick)


BENCHMARKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "engine": _engine,
    "save": _save,
    "serve": _serve,
    "codec": _codec,
    "early": _early,
    "kernels": _kernels,
    "predictor": _predictor,
    "clock": _clock,
    "vllm": _vllm,
}
"""name -> fn(quick, **options); options (`--model`, `--plan`) only for those that take them."""
