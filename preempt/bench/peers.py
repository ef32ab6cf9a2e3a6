"""`preempt bench peers --vidur`: preempt's virtual-clock replay beside Vidur's, on the same
requests, the same deployment and the same KV capacity.

The requests are preempt's (`build_workload`: the azure-conv trace, arrivals divided by the
point's `rate_scale`, max_tokens as clients send it, a 1024 cap); each one's output length
is what preempt generates for it (the true length, capped), and Vidur replays exactly
those rows (preempt.bench.vidur_peer writes its trace CSV with every scale factor 1).
Deployment: Llama-3-70B on two A100-80GB (`2xa100-llama3-70b`), the one Vidur's bundled
profiles cover with measured data (benchmarks/vidur/README.md); preempt's clock uses its A100
profile (fitted to the same Vidur operator times, docs/clock.md). KV capacity: preempt's
usable blocks of 16 tokens, handed to Vidur as `num_blocks`. Scheduling: preempt's
`vllm_fcfs` (step-identical to vLLM 0.32's V1 scheduler: chunked prefill, recompute
preemption of the newest running request) against Vidur's `vllm` scheduler (vLLM V0: whole
prompts, prefill first, restart on preemption; as vLLM V0 without chunked prefill, a batch
holds up to max_model_len tokens).

Per point, each side in its own process: the wall time of the replay alone (its setup
apart: preempt building the engine, Vidur training or loading its execution-time
predictions), the peak RSS, simulated seconds per wall second, TTFT / TPOT / e2e
percentiles over requests that finished, and preemptions (Vidur: restarts). Vidur runs
twice: as shipped, and with the smallest fix of the crash at its first preemption (applied
at run time, said in the result). The speed ratio is Vidur's replay wall time over
preempt's, both measured in this run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from preempt.bench.vidur_peer import percentiles
from preempt.parity.harness import REPO_ROOT, PeerError, venv_python

VIDUR_VERSION = "0.0.26"
VIDUR_ENV = "PREEMPT_VIDUR_PYTHON"
PROFILES = REPO_ROOT / "benchmarks" / "vidur"
TARGET = "2xa100-llama3-70b"
VIDUR_DEPLOYMENT = {
    "model": "meta-llama/Llama-3-70B",
    "device": "a100",
    "network_device": "a100_dgx",
    "tensor_parallel_size": 2,
}
# Vidur's random-forest grid, narrowed to one point and two folds per operator: its default
# (27 points x 10 folds) trains for about an hour on 2 cores before the first request.
FOREST = {"num_estimators": [250], "max_depth": [16], "min_samples_split": [2], "k_fold_cv_splits": 2}
RATE_SCALES = (0.1, 0.5)  # under the deployment's capacity; over it, with memory preemptions
BLOCK_SIZE = 16  # Vidur's attention profile is measured at block size 16


def vidur_python(explicit: str | Path | None = None) -> Path:
    """Vidur's virtualenv Python: the argument, else $PREEMPT_VIDUR_PYTHON, else
    `.vidur/bin/python` here or beside this checkout."""
    return venv_python(
        explicit, VIDUR_ENV, ".vidur", f"run `make vidur` (a .vidur virtualenv with vidur=={VIDUR_VERSION})"
    )


def point_config(rate_scale: float, minutes: float | None) -> dict[str, Any]:
    workload: dict[str, Any] = {"trace": "azure-conv", "rate_scale": rate_scale}
    if minutes is not None:
        workload["duration_s"] = 60 * minutes
    return {
        "model": {"backend": "null"},
        "cache": {"block_size": BLOCK_SIZE},
        "scheduler": {"policy": "vllm_fcfs"},
        "clock": {"target": TARGET},
        "workload": workload,
    }


def _replay_preempt(overrides: dict[str, Any], queue: Any) -> None:
    """In a fresh process (its peak RSS is the replay's own): build, replay, summarize."""
    from preempt.core.config import build_config
    from preempt.core.workload import build_workload
    from preempt.engine.engine import Engine

    start = time.perf_counter()
    config = build_config(overrides)
    requests = build_workload(config.workload, seed=config.seed)
    engine = Engine(config)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.run(requests)
    wall_s = time.perf_counter() - start
    done = [r for r in requests if r.finish_s is not None and r.first_token_s is not None]
    queue.put(
        {
            "setup_s": setup_s,
            "wall_s": wall_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "num_requests": len(requests),
            "num_completed": len(done),
            "num_steps": engine.num_steps,
            "simulated_s": engine.clock.now(),
            "num_preemptions": engine.scheduler.num_preemptions,
            "num_blocks": engine.block_pool.num_blocks,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_model_len": config.model.max_model_len,
            "ttft_s": percentiles([r.first_token_s - r.arrival_s for r in done]),
            "e2e_s": percentiles([r.finish_s - r.arrival_s for r in done]),
            "tpot_s": percentiles(
                [
                    (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
                    for r in done
                    if r.num_output_tokens > 1 and r.num_preemptions == 0
                ]
            ),
            # what Vidur replays: arrival, prompt tokens, the output preempt generated
            "requests": [[r.arrival_s, r.num_prompt_tokens, r.num_output_tokens] for r in requests],
        }
    )


def replay_preempt(overrides: dict[str, Any]) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_replay_preempt, args=(overrides, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def replay_vidur(python: Path, spec: dict[str, Any], work_dir: Path, timeout_s: float = 3600) -> dict:
    """One replay in Vidur's virtualenv (preempt.bench.vidur_peer); its result JSON."""
    spec_path, out_path = work_dir / "spec.json", work_dir / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    proc = subprocess.run(
        [str(python), "-m", "preempt.bench.vidur_peer", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0 or not out_path.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise PeerError(f"Vidur exited with {proc.returncode}:\n{tail}")
    return json.loads(out_path.read_text())


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b > 0 else None


def bench_peers(
    python: Path,
    quick: bool = False,
    rate_scales: tuple[float, ...] = RATE_SCALES,
    cache_dir: Path | None = None,
    minutes: float | None = None,
) -> dict[str, Any]:
    """Every point: preempt, Vidur as shipped, Vidur with the restart fixed. The trace's
    first `minutes` (`quick`: 10), else the hour. Vidur's trained predictions are cached in
    `cache_dir` (runs/vidur_cache), so only the first run pays their training."""
    if minutes is None and quick:
        minutes = 10.0
    cache = cache_dir or REPO_ROOT / "runs" / "vidur_cache"
    points = []
    for rate_scale in rate_scales:
        ours = replay_preempt(point_config(rate_scale, minutes))
        requests = ours.pop("requests")
        spec = {
            **VIDUR_DEPLOYMENT,
            "requests": requests,
            "gpu_memory_utilization": 0.9,
            "block_size": BLOCK_SIZE,
            "num_blocks": ours["num_blocks"],
            "max_num_seqs": ours["max_num_seqs"],
            # vLLM V0 without chunked prefill requires max_num_batched_tokens >= max_model_len:
            # a restarted request prefills its prompt and every token it had made at once
            "max_tokens_in_batch": ours["max_model_len"],
            "max_model_len": ours["max_model_len"],
            "profiles": {
                "compute": str(PROFILES / "a100_meta-llama_Meta-Llama-3-70B_mlp.csv.xz"),
                "attention": str(PROFILES / "a100_attention.csv.xz"),
                "all_reduce": str(PROFILES / "a100_dgx_all_reduce.csv.xz"),
            },
            "forest": FOREST,
            "cache_dir": str(cache),
        }
        sides: dict[str, Any] = {"preempt": ours}
        for name, patch in (("vidur", False), ("vidur_restart_fixed", True)):
            with tempfile.TemporaryDirectory(prefix="preempt-bench-vidur-") as tmp:
                sides[name] = replay_vidur(python, {**spec, "patch_restart": patch}, Path(tmp))
        for side in sides.values():
            side["sim_s_per_wall_s"] = _ratio(side["simulated_s"], side["wall_s"])
        fixed = sides["vidur_restart_fixed"]
        points.append(
            {
                "rate_scale": rate_scale,
                **sides,
                "vidur_over_preempt_wall": _ratio(fixed["wall_s"], ours["wall_s"]),
                "vidur_over_preempt_peak_rss": _ratio(fixed["peak_rss_mb"], ours["peak_rss_mb"]),
            }
        )
    return {
        "bench": "peers",
        "peer": f"vidur {VIDUR_VERSION}",
        "trace": "azure-conv" + (f" (first {minutes:g} min)" if minutes else " (the hour)"),
        "target": TARGET,
        "profiles": {
            "preempt": "preempt/profiles/a100.json (fitted to Vidur's A100 operator times)",
            "vidur": "benchmarks/vidur (Vidur's own A100 profiling CSVs, random forest, narrowed grid)",
        },
        "points": points,
    }


def _preemptions(side: dict[str, Any]) -> str:
    return str(side["num_preemptions"] if "num_preemptions" in side else side["num_restarts"])


def render_peers(result: dict[str, Any]) -> str:
    """One markdown table per point: preempt, Vidur as shipped, Vidur with the fix."""
    sides = (
        ("preempt", "preempt"),
        ("vidur", "Vidur as shipped"),
        ("vidur_restart_fixed", "Vidur, restart fixed"),
    )
    head = "| | " + " | ".join(title for _, title in sides) + " |"
    lines = [f"{result['peer']} vs preempt, {result['trace']}, {result['target']}"]
    for point in result["points"]:
        lines += ["", f"rate_scale {point['rate_scale']}", "", head]
        lines.append("| --- |" + " --- |" * len(sides))

        def row(label: str, value: Any, point: dict[str, Any] = point) -> str:
            return f"| {label} | " + " | ".join(value(point[k]) for k, _ in sides) + " |"

        def q(metric: str, p: str) -> Any:
            return lambda s: "-" if s[metric][p] is None else f"{s[metric][p]:.3g}"

        lines += [
            row("replay wall s", lambda s: f"{s['wall_s']:.2f}"),
            row("setup s", lambda s: f"{s['setup_s']:.1f}"),
            row("peak RSS MB", lambda s: f"{s['peak_rss_mb']:.0f}"),
            row("simulated s / wall s", lambda s: f"{s['sim_s_per_wall_s']}"),
            row("requests finished", lambda s: f"{s['num_completed']}/{s['num_requests']}"),
            row("preemptions (Vidur: restarts)", _preemptions),
            row("TTFT p50 / p99 s", lambda s: f"{q('ttft_s', 'p50')(s)} / {q('ttft_s', 'p99')(s)}"),
            row("TPOT p50 / p99 s", lambda s: f"{q('tpot_s', 'p50')(s)} / {q('tpot_s', 'p99')(s)}"),
            row("e2e p50 / p99 s", lambda s: f"{q('e2e_s', 'p50')(s)} / {q('e2e_s', 'p99')(s)}"),
            row("error", lambda s: s.get("error_where") or s.get("error") or ""),
        ]
        lines.append(
            f"\nVidur (restart fixed) / preempt: replay wall {point['vidur_over_preempt_wall']}x, "
            f"peak RSS {point['vidur_over_preempt_peak_rss']}x"
        )
    return "\n".join(lines)
