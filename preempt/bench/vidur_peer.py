"""Runs one replay in Vidur (microsoft/vidur 0.0.26), inside Vidur's own virtualenv
(`make vidur`): `.vidur/bin/python -m preempt.bench.vidur_peer SPEC.json OUT.json`.

`preempt bench peers --vidur` (preempt.bench.peers) writes the spec: the requests (the
same ones preempt replays: arrival, prompt and output tokens), the deployment, the KV
capacity in blocks, the batch limits, and Vidur's profiling CSVs on disk. This module
touches Vidur only through its public configs and classes, with three changes made at run
time, each said in the output:
- profiles from local files: Vidur 0.0.26 downloads its profiling data and its cached
  predictions from the Hugging Face hub at start-up; here `_get_input_files` returns the
  bundled CSVs and the hub lookup of predictions is skipped (no network);
- the trace replay with every scale factor 1: Vidur's defaults multiply prompts by 0.3
  and arrival times by 0.04;
- with `patch_restart`, the smallest fix of the crash at Vidur's first preemption:
  `Request.restart()` leaves the per-stage counters (`_num_stage_processed_tokens`,
  `_is_prefill_stage_complete`) of the first attempt, and the restarted prefill trips the
  assertion `num_stage_processed_tokens <= total_tokens`; the fix resets them.

Imports only the standard library at module level: Vidur (and its pandas) are imported
by `main`, in Vidur's virtualenv.
"""

from __future__ import annotations

import csv
import json
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

TRACE_DATE = "2024-01-01"  # Vidur's trace replay keeps the rows of one `Date`


def write_trace(requests: list[list[float]], path: Path) -> None:
    """[arrival_s, prompt_tokens, output_tokens] rows -> Vidur's trace CSV."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for arrival_s, prompt, output in requests:
            out.writerow([TRACE_DATE, repr(float(arrival_s)), int(prompt), int(output)])


def _patch_restart(request_cls: Any) -> None:
    original = request_cls.restart

    def restart(self: Any) -> None:
        original(self)
        self._num_stage_processed_tokens = 0
        self._is_prefill_stage_complete = False

    request_cls.restart = restart


def _local_profiles(predictor_cls: Any, files: dict[str, str]) -> None:
    def input_files(self: Any) -> tuple[str, str, str, str]:
        # send_recv: pipeline parallelism only (one stage here), never read
        return files["compute"], files["attention"], files["all_reduce"], files["all_reduce"]

    def no_hub(self: Any) -> Any:
        raise RuntimeError("offline: predictions are trained from the local profiles")

    predictor_cls._get_input_files = input_files
    predictor_cls._load_predictions_from_hf = no_hub


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # numpy's default (linear) percentile
        k = (len(ordered) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": sum(ordered) / len(ordered)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import vidur.config as vc
    from vidur.entities import Request
    from vidur.execution_time_predictor.sklearn_execution_time_predictor import (
        SklearnExecutionTimePredictor,
    )
    from vidur.request_generator.trace_replay_request_generator import TraceReplayRequestGenerator
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    _local_profiles(SklearnExecutionTimePredictor, spec["profiles"])
    if spec["patch_restart"]:
        _patch_restart(Request)
    generated: list[Any] = []
    generate = TraceReplayRequestGenerator.generate_requests

    def keep(self: Any) -> list[Any]:
        generated.extend(generate(self))
        return generated

    TraceReplayRequestGenerator.generate_requests = keep

    work = Path(spec["work_dir"])
    trace = work / "trace.csv"
    write_trace(spec["requests"], trace)
    config = vc.SimulationConfig(
        seed=spec.get("seed", 42),
        log_level="error",
        cluster_config=vc.ClusterConfig(
            num_replicas=1,
            replica_config=vc.ReplicaConfig(
                model_name=spec["model"],
                gpu_memory_utilization=spec["gpu_memory_utilization"],
                num_pipeline_stages=1,
                tensor_parallel_size=spec["tensor_parallel_size"],
                device=spec["device"],
                network_device=spec["network_device"],
            ),
            cache_config=vc.CacheConfig(block_size=spec["block_size"], num_blocks=spec["num_blocks"]),
            global_scheduler_config=vc.RoundRobinGlobalSchedulerConfig(),
            # Vidur's `vllm` scheduler is vLLM V0's: a prompt is prefilled whole, so a batch
            # must hold the longest prompt, and a restarted request's prompt plus what it
            # had made (the spec's `max_tokens_in_batch`)
            replica_scheduler_config=vc.VllmSchedulerConfig(
                batch_size_cap=spec["max_num_seqs"], max_tokens_in_batch=spec["max_tokens_in_batch"]
            ),
        ),
        request_generator_config=vc.TraceRequestGeneratorConfig(
            trace_file=str(trace),
            date=TRACE_DATE,
            prefill_scale_factor=1.0,
            decode_scale_factor=1.0,
            time_scale_factor=1.0,
            max_tokens=spec["max_model_len"],
        ),
        execution_time_predictor_config=vc.RandomForrestExecutionTimePredictorConfig(
            cache_dir=spec["cache_dir"],
            # Vidur's grid search, narrowed by the spec (its default: 27 points x 10 folds
            # per operator, about an hour on 2 cores); predictions only up to the context
            # this deployment serves, not Vidur's default of 2M tokens per request
            num_estimators=spec["forest"]["num_estimators"],
            max_depth=spec["forest"]["max_depth"],
            min_samples_split=spec["forest"]["min_samples_split"],
            k_fold_cv_splits=spec["forest"]["k_fold_cv_splits"],
            prediction_max_batch_size=spec["max_num_seqs"],
            prediction_max_prefill_chunk_size=spec["max_model_len"],
            prediction_max_tokens_per_request=spec["max_model_len"],
            num_training_job_threads=spec["forest"].get("jobs", -1),
        ),
        metrics_config=vc.MetricsConfig(
            write_metrics=False,
            enable_chrome_trace=False,
            store_plots=False,
            store_request_metrics=False,
            store_batch_metrics=False,
            store_utilization_metrics=False,
            output_dir=str(work / "vidur_output"),
        ),
    )
    set_seeds(config.seed)
    out: dict[str, Any] = {"restart_patched": bool(spec["patch_restart"])}
    start = time.perf_counter()
    simulator = Simulator(config)  # trains (or loads cached) execution-time predictions
    out["setup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        simulator.run()
    except Exception as err:  # Vidur's own failure is a result here, not a crash of the bench
        out["error"] = f"{type(err).__name__}: {err}".strip()[:300]
        out["error_where"] = traceback.format_exc().strip().splitlines()[-3].strip()
    out["wall_s"] = time.perf_counter() - start
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    done = [r for r in generated if r.completed]
    out["num_requests"] = len(generated)
    out["num_completed"] = len(done)
    out["simulated_s"] = max((r.completed_at for r in done), default=0.0)
    out["num_restarts"] = sum(r.num_restarts for r in generated)
    out["ttft_s"] = percentiles([r.prefill_completed_at - r.arrived_at for r in done])
    out["e2e_s"] = percentiles([r.completed_at - r.arrived_at for r in done])
    out["tpot_s"] = percentiles(
        [
            (r.completed_at - r.prefill_completed_at) / (r.num_decode_tokens - 1)
            for r in done
            if r.num_decode_tokens > 1 and r.num_restarts == 0
        ]
    )
    return out


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    with tempfile.TemporaryDirectory(prefix="vidur-") as tmp:
        spec.setdefault("work_dir", tmp)
        result = run(spec)
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
