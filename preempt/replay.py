"""One replay: config -> workload -> engine -> contract files.

Owns: the glue `preempt run` (and later `collect` and the ablation arms) share: build the
workload, run the engine with a progress bar, write `requests.parquet` and
`summary.json` (and `preemptions.parquet`, one row per preemption decision). No
decisions and no tensors here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from preempt.config import EngineConfig
from preempt.engine import Engine, StepOutput
from preempt.results import summarize, write_preemptions_parquet, write_requests_parquet, write_summary
from preempt.workload import build_workload


def replay(config: EngineConfig, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    requests = build_workload(config.workload, seed=config.seed)
    engine = Engine(config)

    bar = None
    on_step = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="replay", mininterval=1.0)

        def on_step(output: StepOutput) -> None:
            if output.finished:
                bar.update(len(output.finished))
            bar.set_postfix(
                sim_s=f"{engine.clock.now():.0f}",
                run=len(engine.scheduler.running),
                wait=engine.scheduler.num_waiting,
                refresh=False,
            )

    try:
        engine.run(requests, on_step=on_step)
    finally:
        engine.close()
        if bar is not None:
            bar.close()

    out_dir.mkdir(parents=True, exist_ok=True)
    write_requests_parquet(requests, out_dir / "requests.parquet")
    summary = summarize(
        requests,
        sim_time_s=engine.clock.now(),
        wall_time_s=time.perf_counter() - started,
        config=config.model_dump(mode="json"),
        slo=config.slo,
        extra=engine.stats(),
    )
    write_preemptions_parquet(engine.scheduler.records, out_dir / "preemptions.parquet")
    write_summary(summary, out_dir / "summary.json")
    return summary
