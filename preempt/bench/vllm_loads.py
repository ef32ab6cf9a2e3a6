"""`preempt bench fidelity --loads`: the KV connector's asynchronous loads against
synchronous ones, in a real vLLM, on the model where recomputing costs.

The judge windows of `preempt bench fidelity` (the same served model, engine shape,
requests and pinning) through two `vllm serve`s with vLLM's FCFS scheduler and preempt's
KV connector (raw copies), one loading a resumed request's copy before the forward pass
of the step that resumes it (`loads: sync`), the other on a load thread while vLLM keeps
the request parked (`loads: async`, vLLM's load-ready protocol). Both servers up at once,
each window through one then the other, the order reversed every other window
(`fidelity.serve_interleaved`), so the machine's drift falls on both alike.

Judged from vLLM's own step logs and the client's stream:
- per step: each window's mean step time (scheduled steps), async against sync paired by
  window; and the resume steps (the first step a preempted request runs in again: under
  sync loads it carries the load): their time beyond what a step of their shape takes
  (`_resume_excess`), pooled, with Welch's interval on the difference;
- per request: the requests preempted in both arms, paired: the longest wait between two
  streamed chunks (where a resume's stall shows to a client), e2e latency and TTFT;
- the connector's own counters: saves, loads, mean save and load ms, resume waits.

This module never imports vLLM; the servers are subprocesses.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from preempt.bench.fidelity import QUICK as FIDELITY_QUICK
from preempt.bench.fidelity import (
    FidelitySetup,
    RealArm,
    _preempted,
    all_windows,
    engine_side,
    read_kept,
    serve_interleaved,
    window_index,
)
from preempt.obs.stats import Interval, ratio_interval, t_interval, welch_interval

ARMS = ("sync", "async")
SETUP = FidelitySetup(fit_starts=())  # the judge windows only: nothing is calibrated here
# a smoke run: the tiny model, one short window of 33 requests sent within a second, so
# that its 11 usable blocks run out even at the tiny model's 3 ms steps
QUICK = replace(FIDELITY_QUICK, fit_starts=(), judge_starts=(1500.0,), rate_scale=4.0)


def loads_arms() -> list[RealArm]:
    from preempt.integrations.vllm.kv_store import kv_transfer_config

    return [
        RealArm(
            f"raw_{loads}",
            "fcfs",
            ("--kv-transfer-config", json.dumps(kv_transfer_config({"codec": "raw", "loads": loads}))),
        )
        for loads in ARMS
    ]


def bench_loads(peer_python: Path, work_dir: Path, quick: bool = False) -> dict[str, Any]:
    """Serve the judge windows through both arms (kept in `work_dir`: step logs, the
    client's records in real.json, the servers' logs), then `judge_loads`."""
    setup = QUICK if quick else SETUP
    work_dir.mkdir(parents=True, exist_ok=True)
    windows = {name: requests for name, requests in all_windows(setup).items() if name.startswith("judge")}
    started = time.perf_counter()
    served = serve_interleaved(peer_python, work_dir, setup, loads_arms(), windows)
    kept = {"setup": asdict(setup), "real": served, "real_s": round(time.perf_counter() - started, 1)}
    (work_dir / "real.json").write_text(json.dumps(kept) + "\n")
    return judge_loads(served, list(windows), kept["real_s"])


def _steps(log, run: dict[str, Any], window: str) -> list[tuple[dict, bool]]:
    """The window's scheduled steps, each with whether a preempted request of the window
    ran again first in it (a resume step: under sync loads it carries the load)."""
    waiting: set[str] = set()
    out = []
    for step in log.steps:
        if not run["started"] <= step["t"] < run["ended"] or not step["chunks"]:
            continue
        ids = set(step["ids"])
        out.append((step, bool(waiting & ids)))
        waiting -= ids
        waiting |= {rid for rid, _ in step["preempted"] if window_index(rid, window) is not None}
    return out


def _resume_excess(steps: list[tuple[dict, bool]]) -> list[float]:
    """Seconds each resume step took beyond what a step of its shape takes: a least-squares
    line over the arm's other steps in new tokens, requests and tokens attended (a resume
    step's own shape varies: a lone decode or a 512-token prefill chunk, so raw times
    would compare shapes, not loads)."""

    def features(step: dict) -> list[float]:
        chunks = step["chunks"]
        return [1.0, sum(n for _, n in chunks), len(chunks), sum(b + n for b, n in chunks) / 1e3]

    x = np.array([features(step) for step, _ in steps])
    y = np.array([step["end"] - step["t"] for step, _ in steps])
    resumed = np.array([flag for _, flag in steps], dtype=bool)
    if resumed.all() or not resumed.any():
        return []
    coef, *_ = np.linalg.lstsq(x[~resumed], y[~resumed], rcond=None)
    return [float(v) for v in (y - x @ coef)[resumed]]


def _interval(iv) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in iv._asdict().items()}


def judge_loads(served: dict[str, Any], windows: list[str], real_s: float | None = None) -> dict[str, Any]:
    from preempt.calibrate.vllm_steps import read_step_log

    logs = {loads: read_step_log(served[f"raw_{loads}"]["step_log"]) for loads in ARMS}
    runs = {loads: served[f"raw_{loads}"]["windows"] for loads in ARMS}
    arms: dict[str, Any] = {}
    step_means: dict[str, list[float]] = {}
    resume: dict[str, list[float]] = {}
    for loads in ARMS:
        log, mine = logs[loads], runs[loads]
        spans = [_steps(log, mine[w], w) for w in windows]
        seconds = [[s["end"] - s["t"] for s, _ in steps] for steps in spans]
        step_means[loads] = [float(np.mean(v)) for v in seconds]
        resumes = [s["end"] - s["t"] for steps in spans for s, flag in steps if flag]
        resume[loads] = _resume_excess([pair for steps in spans for pair in steps])
        metrics = served[f"raw_{loads}"].get("metrics", {})
        row: dict[str, Any] = {
            "steps": sum(len(v) for v in seconds),
            "busy_s": round(sum(sum(v) for v in seconds), 3),
            "step_ms": round(1e3 * float(np.mean([v for s in seconds for v in s])), 3),
            "resume_steps": len(resumes),
            "resume_step_ms": round(1e3 * float(np.mean(resumes)), 3) if resumes else None,
            "resume_excess_ms": round(1e3 * float(np.mean(resume[loads])), 3) if resume[loads] else None,
            "preemptions": sum(len(_preempted(log, mine[w], w)) for w in windows),
        }
        for what in ("save", "load"):
            total = metrics.get(f"preempt:kv_{what}_seconds_sum")
            count = metrics.get(f"preempt:kv_{what}_seconds_count")
            row[f"{what}s"] = count
            row[f"{what}_ms"] = round(1e3 * total / count, 3) if total is not None and count else None
        row["resume_waits"] = metrics.get("preempt:kv_resume_waits_total")
        row["fallbacks"] = {k: v for k, v in metrics.items() if k.startswith("preempt:kv_fallbacks")}
        arms[loads] = row
    # the requests preempted in both arms, paired by (window, request)
    both = {
        w: _preempted(logs["sync"], runs["sync"][w], w) & _preempted(logs["async"], runs["async"][w], w)
        for w in windows
    }
    records = {loads: {w: {r["id"]: r for r in runs[loads][w]["records"]} for w in windows} for loads in ARMS}
    engine = {loads: {w: {r["id"]: r for r in engine_side(logs[loads], runs[loads][w], w)["records"]}
                      for w in windows} for loads in ARMS}  # fmt: skip
    paired: dict[str, Any] = {"requests": sum(len(v) for v in both.values())}
    for key, source in (("max_gap_s", records), ("ttft_s", engine), ("e2e_s", engine)):
        diffs = [
            source["async"][w][i][key] - source["sync"][w][i][key]
            for w in windows
            for i in sorted(both[w])
            if i in source["async"][w] and i in source["sync"][w]
        ]
        paired[key] = _interval(t_interval(diffs))
    return {
        "what": "preempt's KV connector (raw) in vLLM FCFS: asynchronous loads against synchronous, "
        "the judge windows of bench fidelity, both servers interleaved window by window",
        "windows": windows,
        "real_s": real_s,
        "arms": arms,
        "step_s_by_window": {loads: [round(v, 6) for v in step_means[loads]] for loads in ARMS},
        "step_difference_s": _interval(t_interval(np.subtract(step_means["async"], step_means["sync"]))),
        "step_ratio": _interval(ratio_interval(step_means["async"], step_means["sync"])),
        "resume_excess_difference_s": _interval(welch_interval(resume["async"], resume["sync"])),
        "victims_async_minus_sync": paired,
    }


def rejudge_loads(work_dir: Path) -> dict[str, Any]:
    """`judge_loads` again on the runs a bench left in `work_dir` (`fidelity.read_kept`)."""
    data = read_kept(work_dir)
    windows = list(next(iter(data["real"].values()))["windows"])
    return judge_loads(data["real"], windows, data.get("real_s"))


def _cell(iv: dict[str, Any], scale: float = 1.0) -> str:
    """A kept interval (`Interval._asdict()`, through JSON) as the stats module prints one."""
    return Interval(**iv).format(scale=scale)


def render_loads(result: dict[str, Any]) -> str:
    arms = result["arms"]
    lines = [
        "| loads | steps | mean step ms | busy s | resume steps | their mean ms | beyond their shape's ms | "
        "preempted requests | saves / loads | save / load ms | resume waits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for loads, row in arms.items():
        lines.append(
            f"| {loads} | {row['steps']} | {row['step_ms']} | {row['busy_s']} | {row['resume_steps']} | "
            f"{row['resume_step_ms']} | {row['resume_excess_ms']} | {row['preemptions']} | "
            f"{row['saves']} / {row['loads']} | "
            f"{row['save_ms']} / {row['load_ms']} | {row['resume_waits']} |"
        )
    v = result["victims_async_minus_sync"]
    lines += [
        "",
        f"- mean step, async minus sync, paired by window ({len(result['windows'])}): "
        f"{_cell(result['step_difference_s'], 1e3)} ms; ratio {_cell(result['step_ratio'])}",
        "- a resume step's time beyond its shape's (a line fitted on the arm's other steps), async "
        f"minus sync (Welch): {_cell(result['resume_excess_difference_s'], 1e3)} ms",
        f"- the {v['requests']} requests preempted in both arms, async minus sync: longest stream gap "
        f"{_cell(v['max_gap_s'])} s, TTFT {_cell(v['ttft_s'])} s, e2e {_cell(v['e2e_s'])} s",
    ]
    return "\n".join(lines)
