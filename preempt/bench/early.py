"""`preempt bench early`: how much of the preemption stall early work hides, and at what cost.

1. Virtual clock (`null` backend, the collect workload: azure-conv at 4x with a VIP mix
   and a small KV pool, so both priority and memory preemptions happen), modes `swap`
   (raw) and `swap_zstd` (and `swap_mixed` unless --quick). In the same run, one replay
   per arm: `none` (no early work: the baseline), `prefetch` (restore prefetch only), and
   each early-save policy with restore prefetch on: `rule`, `lookahead` (the oracle:
   forks the engine and simulates ahead, an upper bound), `oracle_log` (the older oracle
   that replays the `prefetch` arm's preemptions), `lstm` when `--model` names a
   predictor checkpoint. Per arm: the save-side stall (compute waiting for a victim's
   copy-out), the restore stall, their sum, `stall_hidden` = 1 - total(arm) /
   total(none) and `save_stall_hidden` likewise for the save side only; early bytes
   claimed by preemptions and wasted (the request finished, or the copy was evicted),
   `waste_share` = wasted / early-saved bytes; prefetch hits, misses and bytes wasted,
   copy-ins claimed at admission and those of them started with no step of lead.
   The same arms again with asynchronous restores (`preemption.async_restore`: a restored
   request waits out of the batch for its copy-in) for `swap` and `swap_zstd`
   (`virtual_async_restore`); there `stall_hidden` is against the synchronous `none` arm
   (the stall with no early work and no async restore), `stall_hidden_vs_async_none`
   against the async `none` arm, and `restore_wait_s` is the request-side wait the batch
   did not stall on.
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

from preempt.core.config import build_config, load_config
from preempt.engine.engine import Engine
from preempt.replay import replay

_COLLECT = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "collect.yaml"


def bench_early(quick: bool, model: str | None = None) -> dict[str, Any]:
    modes = ("swap", "swap_zstd") if quick else ("swap", "swap_zstd", "swap_mixed")
    horizon = _horizon_of(model) if model else []
    result: dict[str, Any] = {"virtual": {m: _virtual(m, quick, model, horizon) for m in modes}}
    result["virtual_async_restore"] = {
        m: _virtual(m, quick, model, horizon, async_restore=True, baseline=result["virtual"][m])
        for m in ASYNC_MODES
    }
    result["horizon"] = horizon
    result["wall"] = _wall(num_steps=5 if quick else 20)
    return result


def _horizon_of(model: str) -> list[str]:
    """The checkpoint's horizon, feature set and stride, for every arm (the oracle looks
    as far; the stride is the `lstm` arm's, and the others ignore it)."""
    from preempt.engine.online_predictor import load_checkpoint

    _, hparams = load_checkpoint(model)
    return [
        f"early_save.horizon_ms={float(hparams.get('horizon_ms', 50.0))}",
        f"early_save.horizon_steps={int(hparams.get('horizon_steps', 0))}",
        f"early_save.feature_set={hparams.get('feature_set', 'v1')}",
        f"early_save.every_k_steps={int(hparams.get('every_k_steps', 1))}",
    ]


ARMS = ("none", "prefetch", "rule", "lookahead", "oracle_log")
ASYNC_MODES = ("swap", "swap_zstd")


def _virtual(
    mode: str,
    quick: bool,
    model: str | None,
    horizon: list[str] | None = None,
    async_restore: bool = False,
    baseline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One mode's arms. `async_restore`: with asynchronous restores; `stall_hidden` is then
    against `baseline`'s `none` arm (the same mode without them)."""
    duration = 60 if quick else 200
    overrides = [f"workload.duration_s={duration}", f"preemption.mode={mode}", *(horizon or [])]
    if async_restore:
        overrides.append("preemption.async_restore=true")
    arms = list(ARMS) + (["lstm"] if model else [])
    out: dict[str, Any] = {"workload": f"{_COLLECT.name}, {duration} s of trace", "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            extra = [] if arm == "none" else ["early_save.prefetch=true"]
            policy = {"none": "none", "prefetch": "none", "oracle_log": "oracle"}.get(arm, arm)
            extra.append(f"early_save.policy={policy}")
            if arm == "oracle_log":
                extra.append(f"early_save.oracle_log={Path(tmp) / 'prefetch' / 'preemptions.parquet'}")
            if arm == "lstm":
                extra.append(f"early_save.checkpoint={model}")
            config = load_config(_COLLECT, overrides + extra)
            summary = replay(config, Path(tmp) / arm, progress=False)
            out["policies"][arm] = _row(summary)
    base = (baseline or out)["policies"]["none"]
    own = out["policies"]["none"]
    for row in out["policies"].values():
        row["stall_hidden"] = _hidden(row["stall_total_s"], base["stall_total_s"])
        row["save_stall_hidden"] = _hidden(row["stall_save_s"], base["stall_save_s"])
        if baseline is not None:
            row["stall_hidden_vs_async_none"] = _hidden(row["stall_total_s"], own["stall_total_s"])
    return out


def _hidden(stall: float, base: float) -> float | None:
    return round(1 - stall / base, 3) if base > 0 else None


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
        "stall_total_s": round(summary["preemption_stall_s"], 4),
        # Restores that found their copy-in (or decode) done ahead: ended by the admission
        # (hits), still running then (late); none done ahead (misses).
        "prefetch_hits": summary.get("num_prefetch_hits"),
        "prefetch_hits_late": summary.get("num_prefetch_hits_late"),
        "prefetch_misses": summary.get("num_prefetch_misses"),
        "prefetch_gb": round(summary.get("prefetch_bytes", 0) / 1e9, 3),
        "prefetch_wasted_gb": round(summary.get("prefetch_bytes_wasted", 0) / 1e9, 3),
        # Copy-ins claimed at admission, and those started right before it (no lead).
        "prefetch_admitted": summary.get("num_prefetch_admitted"),
        "prefetch_admitted_without_lead": summary.get("num_prefetch_admitted_without_lead"),
        # Async restores: requests that waited out of the batch for their copy-in, and the
        # summed wait (their latency includes it; the batch did not stall on it).
        "num_async_restores": summary.get("num_async_restores"),
        "restore_wait_s": _rounded(summary.get("preemption_restore_wait_s")),
        "e2e_p50_s": _rounded(summary.get("e2e_p50_s")),
        "e2e_p99_s": _rounded(summary.get("e2e_p99_s")),
        "wall_time_s": round(summary["wall_time_s"], 2),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


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
            "num_early_saves": engine.saver.early.num_early_saves,
        }
    return {
        "setup": "tiny-2l fp32, 16 requests decoding at 512+ tokens, one torch thread, swap_zstd",
        "policies": times,
        "step_time_ratio_always_vs_none": round(
            times["always"]["step_ms_median"] / times["none"]["step_ms_median"], 3
        ),
    }
