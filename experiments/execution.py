"""Executing a plan's runs: in this process (one job) or as Ray tasks (local or a cluster).

Owns: `run_arm` (replay one run's config into its directory and return its metrics),
`execute` (every non-skipped run of a plan, references before the runs that replay them,
`--resume` reuse), and starting and stopping Ray. With `jobs > 1` or a `ray_address` each
run is one Ray task (`num_cpus=1`, one torch thread); Ray schedules them on this machine
(`ray.init(address="local", num_cpus=jobs)`: a Ray instance of its own, never one that
happens to run here, such as a user's sweep; no dashboard; stopped after) or on the
cluster at `ray_address`. There is no process pool of ours.

Must never: change a run's config, or let one failed run lose the others (errors come back
as values). Results do not depend on where a run ran: same config + seed give the same
metrics on the virtual clock (only `wall_time_s` varies), which the tests check through
Ray against a local run.

On a cluster every node needs this package installed (same version) and the output
directory on a shared filesystem: tasks write their run files under it, and oracle arms
and derived inputs (`experiments.derive`) are read from it.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.catalogue import NAN
from experiments.plan import AblationPlan, ArmRun
from experiments.wandb_sink import jsonable


def init_worker() -> None:
    # Runs go side by side, one per core: a second OpenMP thread per process would fight
    # the other runs for the same cores (measured: several times slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def run_arm(key: str, config_json: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Replay one run into `run_dir` and return {"status", "metrics" | "error"}. Errors
    come back as values so one broken run cannot lose the rest."""
    from experiments.measure import run_metrics
    from preempt.core.config import build_config
    from preempt.replay import replay

    try:
        config = build_config(config_json)
        path = Path(run_dir)
        summary = replay(config, path, progress=False)
        metrics = run_metrics(path, summary)
        (path / "metrics.json").write_text(
            json.dumps({"run": key, "config": config_json, "metrics": jsonable(metrics)}, indent=1) + "\n"
        )
        return {"status": "ok", "metrics": metrics}
    except Exception as err:  # reported in the table and by the exit status
        return {"status": "failed", "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}


def _ray_task(key: str, config_json: dict[str, Any], run_dir: str) -> dict[str, Any]:
    init_worker()
    return run_arm(key, config_json, run_dir)


def _reused(run: ArmRun, run_dir: Path) -> dict[str, Any] | None:
    """`--resume`: the metrics of an earlier run of exactly this config, if any."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("config") != run.config.model_dump(mode="json"):
        return None
    return {"status": "ok", "metrics": {k: NAN if v is None else v for k, v in saved["metrics"].items()}}


def default_jobs(num_runs: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, num_runs))


class RayRunner:
    """Ray for one `execute`: started here unless the caller already initialised it (then
    left running), shut down after. Local: `num_cpus=jobs`; a cluster: `address`."""

    def __init__(self, jobs: int, address: str | None) -> None:
        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            kwargs: dict[str, Any] = dict(
                include_dashboard=False,
                log_to_driver=False,  # the runs print nothing; Ray's own chatter stays in its logs
                configure_logging=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            )
            if address:
                kwargs["address"] = address
            else:
                # "local": start an instance of our own; without it ray.init attaches to the
                # cluster last started on this machine, if any (and shutting down would
                # then leave it to whoever started it, with our tasks on it)
                kwargs.update(address="local", num_cpus=jobs)
            ray.init(**kwargs)
        self.task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert fn is run_arm
        return self.task.remote(*args)

    def wait_one(self, refs: list[Any]) -> tuple[Any, dict[str, Any]]:
        done, _ = self.ray.wait(refs, num_returns=1)
        ref = done[0]
        try:
            return ref, self.ray.get(ref)
        except Exception as err:  # the worker itself died (e.g. killed for memory)
            return ref, {"status": "failed", "error": f"worker died: {type(err).__name__}: {err}"}

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def execute(
    plan: AblationPlan,
    out_dir: Path,
    jobs: int,
    *,
    resume: bool = False,
    on_done: Callable[[ArmRun, dict[str, Any]], None] | None = None,
    ray_address: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every non-skipped run; returns run key -> outcome. Runs whose reference has not
    finished wait for it; with a failed reference they are skipped. jobs=1 without a Ray
    address runs in this process (no start-up cost); otherwise every run is a Ray task."""
    outcomes: dict[str, dict[str, Any]] = {}
    todo = [run for run in plan.runs if run.skip_reason is None]
    for run in plan.runs:
        if run.skip_reason is not None:
            outcomes[run.key] = {"status": "skipped", "error": run.skip_reason}

    def finish(run: ArmRun, outcome: dict[str, Any]) -> None:
        outcomes[run.key] = outcome
        if on_done is not None:
            on_done(run, outcome)

    def ready(run: ArmRun) -> bool:
        return run.reference is None or run.reference in outcomes

    def reference_failed(run: ArmRun) -> str | None:
        ref = outcomes.get(run.reference) if run.reference else None
        if ref is not None and ref["status"] != "ok":
            return f"reference arm '{run.reference}' {ref['status']}"
        return None

    def start(run: ArmRun, submit: Callable[..., Any]) -> Any:
        run_dir = out_dir / "arms" / run.key
        if (failed := reference_failed(run)) is not None:
            finish(run, {"status": "skipped", "error": failed})
            return None
        if resume and (outcome := _reused(run, run_dir)) is not None:
            finish(run, outcome)
            return None
        return submit(run_arm, run.key, run.config.model_dump(mode="json"), str(run_dir))

    if jobs <= 1 and ray_address is None:
        init_worker()
        pending = list(todo)
        while pending:
            run = next(r for r in pending if ready(r))
            pending.remove(run)
            result = start(run, lambda fn, *args: fn(*args))
            if result is not None:
                finish(run, result)
        return outcomes

    runner = RayRunner(jobs, ray_address)
    try:
        refs: dict[Any, ArmRun] = {}
        pending = list(todo)
        while pending or refs:
            for run in [r for r in pending if ready(r)]:
                pending.remove(run)
                ref = start(run, runner.submit)
                if ref is not None:
                    refs[ref] = run
            if not refs:
                continue  # started nothing, but finishing made more runs ready
            ref, outcome = runner.wait_one(list(refs))
            finish(refs.pop(ref), outcome)
    finally:
        runner.close()
    return outcomes
