"""One replay: config -> workload -> engine -> contract files.

Owns: the glue `preempt run` (and later `collect` and the ablation arms) share: build the
workload, run the engine with a progress bar, write `requests.parquet` and
`summary.json` (and `preemptions.parquet`, one row per preemption decision). No
decisions and no tensors here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from preempt.core.config import EngineConfig
from preempt.core.request import Request
from preempt.core.workload import build_workload
from preempt.engine.engine import Engine
from preempt.engine.view import EngineView, StepOutput
from preempt.obs.results import summarize, write_preemptions_parquet, write_requests_parquet, write_summary


def run_summary(engine: Engine, requests: list, config: EngineConfig, started: float) -> dict[str, Any]:
    """The run's summary.json object, after `engine.run(requests)` (`started`: its
    perf_counter at the start, for the wall time)."""
    return summarize(
        requests,
        sim_time_s=engine.clock.now(),
        wall_time_s=time.perf_counter() - started,
        config=config.model_dump(mode="json"),
        slo=config.slo,
        extra=engine.stats(),
    )


def replay(
    config: EngineConfig,
    out_dir: Path,
    progress: bool = True,
    on_step: Callable[[EngineView, StepOutput], None] | None = None,
) -> dict[str, Any]:
    """Run `config`'s workload and write the run's files; `on_step(view, output)`, if
    given, sees every step through the engine's read-only view (e.g. `preempt collect`'s
    feature logger)."""
    started = time.perf_counter()
    engine = Engine(config)
    requests = build_workload(config.workload, seed=config.seed, vocab_size=engine.runner.vocab_size)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="replay", mininterval=1.0)

    def hook(output: StepOutput) -> None:
        on_step(engine.view, output)

    def finished(done: list[Request]) -> None:
        bar.update(len(done))
        bar.set_postfix(
            sim_s=f"{engine.clock.now():.0f}",
            run=len(engine.scheduler.running),
            wait=engine.scheduler.num_waiting,
            refresh=False,
        )

    try:
        # The bar moves as requests finish, which keeps the engine's decode runs on (a
        # step hook would see every step, so it turns them off).
        engine.run(
            requests,
            on_step=hook if on_step is not None else None,
            on_finished=finished if bar is not None else None,
        )
    finally:
        engine.close()
        if bar is not None:
            bar.close()

    out_dir.mkdir(parents=True, exist_ok=True)
    write_requests_parquet(requests, out_dir / "requests.parquet")
    summary = run_summary(engine, requests, config, started)
    write_preemptions_parquet(engine.scheduler.records, out_dir / "preemptions.parquet")
    write_summary(summary, out_dir / "summary.json")
    return summary
