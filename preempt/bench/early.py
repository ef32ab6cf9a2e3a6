"""`preempt bench early`: how much of the preemption stall early saves hide, and at what cost.

1. Virtual clock (`null` backend, the collect workload: azure-conv at 4x with a VIP mix
   and a small KV pool, so both priority and memory preemptions happen): one replay per
   early-save policy, each against `none` in the same run. Per policy: the save-side
   stall (compute waiting for a victim's copy-out: what an early save can hide),
   `stall_hidden` = 1 - stall(policy) / stall(none), early bytes claimed by preemptions
   and wasted (the request finished, or the copy was evicted for a demand save), and
   `waste_share` = wasted / early-saved bytes. `oracle` replays the `none` run's
   preemptions; `lstm` runs only when `--model` names a predictor checkpoint.
   Restores are never hidden by an early save (they need the host copy back); their
   stall is reported next to it.
2. Wall clock (tiny model on CPU, swap_zstd): median engine step time while every
   running request is early-saved each step (write-through, the heaviest policy), against
   no early saves, in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from preempt.config import build_config, load_config
from preempt.engine import Engine
from preempt.replay import replay

_COLLECT = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "collect.yaml"


def bench_early(quick: bool, model: str | None = None) -> dict[str, Any]:
    modes = ("swap",) if quick else ("swap", "swap_mixed", "swap_zstd")
    result: dict[str, Any] = {"virtual": {m: _virtual(m, quick, model) for m in modes}}
    result["wall"] = _wall(num_steps=5 if quick else 20)
    return result


def _virtual(mode: str, quick: bool, model: str | None) -> dict[str, Any]:
    duration = 60 if quick else 200
    overrides = [f"workload.duration_s={duration}", f"preemption.mode={mode}"]
    policies = ["none", "always", "rule", "oracle"] + (["lstm"] if model else [])
    out: dict[str, Any] = {"workload": f"{_COLLECT.name}, {duration} s of trace", "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in policies:
            extra = [f"early_save.policy={policy}"]
            if policy == "oracle":
                extra.append(f"early_save.oracle_log={Path(tmp) / 'none' / 'preemptions.parquet'}")
            if policy == "lstm":
                extra.append(f"early_save.checkpoint={model}")
            config = load_config(_COLLECT, overrides + extra)
            summary = replay(config, Path(tmp) / policy, progress=False)
            out["policies"][policy] = _row(summary)
    base = out["policies"]["none"]["stall_save_s"]
    for row in out["policies"].values():
        row["stall_hidden"] = round(1 - row["stall_save_s"] / base, 3) if base > 0 else None
    return out


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    early = summary.get("early_bytes_raw", 0)
    return {
        "num_preemptions": summary["num_preemptions"],
        "stall_save_s": round(summary["preemption_stall_save_s"], 4),
        "stall_restore_s": round(summary["preemption_stall_restore_s"], 4),
        "num_early_saves": summary.get("num_early_saves", 0),
        "early_gb": round(early / 1e9, 3),
        "early_used_gb": round(summary.get("early_bytes_used", 0) / 1e9, 3),
        "early_wasted_gb": round(summary.get("early_bytes_wasted", 0) / 1e9, 3),
        "waste_share": round(summary["early_bytes_wasted"] / early, 3) if early else None,
        "wall_time_s": round(summary["wall_time_s"], 2),
    }


def _wall(num_steps: int) -> dict[str, Any]:
    from preempt.bench.save import _long_request, _prefill

    times = {}
    for policy in ("none", "always"):
        config = build_config(
            {
                "model": {"backend": "tiny", "num_threads": 1, "max_model_len": 4096},
                "cache": {"num_blocks": 2048},
                "clock": {"kind": "wall"},
                "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 8192},
                "preemption": {"mode": "swap_zstd", "host_mem": "2GB", "slot_size": "64MB"},
                "early_save": {"policy": policy, "host_budget": "2GB", "max_inflight": 64},
            }
        )
        engine = Engine(config)
        requests = [_long_request(i, 512, max_tokens=8 * num_steps) for i in range(16)]
        _prefill(engine, requests)
        step_times = []
        for _ in range(num_steps):
            started = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - started)
        engine.close()
        times[policy] = {
            "step_ms_median": round(1000 * statistics.median(step_times), 3),
            "num_early_saves": engine.saver.num_early_saves,
        }
    return {
        "setup": "tiny-2l fp32, 16 requests decoding at 512+ tokens, one torch thread, swap_zstd",
        "policies": times,
        "step_time_ratio_always_vs_none": round(
            times["always"]["step_ms_median"] / times["none"]["step_ms_median"], 3
        ),
    }
