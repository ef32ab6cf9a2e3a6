"""Run outputs: `requests.parquet` (one row per request) and `summary.json`.

Owns: the *contract* columns and keys of docs/design.md "Files", the summary's statistics
and the output digest. It reads finished requests; it never changes them.

Definitions (seconds on the engine's clock):
- ttft_s, tpot_s, e2e_s: `preempt.obs.latency` (their one definition); NaN here for
  requests that did not finish, and tpot_s NaN for one-token outputs
- goodput_req_s = requests that finished within their SLA level's TTFT and TPOT SLOs,
  per second of simulated time.
- output_digest = blake2b-128 of the generated token ids (little-endian int32): equal
  digests mean identical outputs, so lossless preemption modes can be checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from preempt.core.config import SLOConfig
from preempt.core.request import Request, RequestState
from preempt.kv.record import PreemptionRecord
from preempt.obs.latency import e2e_s, tpot_s, ttft_s


def output_digest(token_ids: Sequence[int]) -> str:
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _latencies(request: Request) -> tuple[float, float, float]:
    nan = float("nan")
    if request.state is not RequestState.FINISHED:
        return nan, nan, nan
    tpot = tpot_s(request)
    return ttft_s(request), nan if tpot is None else tpot, e2e_s(request)


# The contract columns (docs/design.md "Files"), then our extensions.
REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.int64()),
        ("arrival_s", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("max_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("sla_level", pa.int64()),
        ("ttft_s", pa.float64()),
        ("tpot_s", pa.float64()),
        ("e2e_s", pa.float64()),
        ("num_preemptions", pa.int64()),
        ("final_state", pa.string()),
        ("output_digest", pa.string()),
        ("abort_reason", pa.string()),
        ("preemption_failed", pa.bool_()),
        # The tokens themselves, so lossy modes can be scored (greedy agreement with a
        # lossless run) and not only detected by the digest.
        ("output_token_ids", pa.list_(pa.int32())),
    ]
)


def _request_row(r: Request) -> dict[str, Any]:
    ttft, tpot, e2e = _latencies(r)
    return {
        "request_id": r.request_id,
        "arrival_s": r.arrival_s,
        "prompt_tokens": r.num_prompt_tokens,
        "max_tokens": r.max_tokens,
        "output_tokens": r.num_output_tokens,
        "sla_level": r.sla_level,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "num_preemptions": r.num_preemptions,
        "final_state": r.state.value,
        "output_digest": output_digest(r.output_token_ids),
        "abort_reason": r.abort_reason,
        "preemption_failed": r.preemption_failed,
        "output_token_ids": list(r.output_token_ids),
    }


def requests_table(requests: Sequence[Request]) -> pa.Table:
    rows = [_request_row(r) for r in sorted(requests, key=lambda r: r.request_id)]
    return pa.Table.from_pylist(rows, schema=REQUESTS_SCHEMA)


def write_requests_parquet(requests: Sequence[Request], path: Path) -> None:
    # Fixed writer options, no timestamps in metadata: byte-identical files for
    # identical runs (the reproducibility test compares bytes).
    pq.write_table(requests_table(requests), path, compression="zstd", write_statistics=False)


def write_preemptions_parquet(records: Sequence[PreemptionRecord], path: Path) -> None:
    """One row per preemption decision (also failed attempts and reclaims of paused
    requests): time, victim, reason, what happened to its KV, bytes and durations."""
    fields = [f.name for f in dataclasses.fields(PreemptionRecord)]
    columns = {name: [getattr(r, name) for r in records] for name in fields}
    schema = pa.schema(
        [
            ("time_s", pa.float64()),
            ("request_id", pa.int64()),
            ("reason", pa.string()),
            ("action", pa.string()),
            ("num_tokens", pa.int64()),
            ("challenger_id", pa.int64()),
            ("slice_used_s", pa.float64()),
            ("slice_s", pa.float64()),
            ("failure", pa.string()),
            ("codec", pa.string()),
            ("bytes_raw", pa.int64()),
            ("bytes_early", pa.int64()),
            ("bytes_stored", pa.int64()),
            ("save_s", pa.float64()),
            ("restore_s", pa.float64()),
            ("restored", pa.bool_()),
            ("warmup_tokens", pa.int64()),
        ]
    )
    pq.write_table(pa.table(columns, schema=schema), path, compression="zstd", write_statistics=False)


def _percentile(values: list[float], q: float) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.percentile(finite, q)) if finite else None


def _latency_stats(requests: Sequence[Request], slo: SLOConfig) -> dict[str, Any]:
    ttfts, tpots, e2es = [], [], []
    num_good = 0
    for r in requests:
        ttft, tpot, e2e = _latencies(r)
        ttfts.append(ttft)
        tpots.append(tpot)
        e2es.append(e2e)
        ttft_slo, tpot_slo = slo.for_level(r.sla_level)
        if r.state is RequestState.FINISHED and ttft <= ttft_slo and (math.isnan(tpot) or tpot <= tpot_slo):
            num_good += 1
    return {
        "num_requests": len(requests),
        "num_finished": sum(r.state is RequestState.FINISHED for r in requests),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "tpot_p50_s": _percentile(tpots, 50),
        "tpot_p99_s": _percentile(tpots, 99),
        "e2e_p50_s": _percentile(e2es, 50),
        "e2e_p99_s": _percentile(e2es, 99),
        "num_slo_met": num_good,
        "slo_attainment": num_good / len(requests) if requests else None,
    }


def summarize(
    requests: Sequence[Request],
    *,
    sim_time_s: float,
    wall_time_s: float,
    config: dict[str, Any],
    slo: SLOConfig,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    overall = _latency_stats(requests, slo)
    levels = sorted({r.sla_level for r in requests})
    summary: dict[str, Any] = {
        **overall,
        "num_aborted": sum(r.state is RequestState.ABORTED for r in requests),
        "num_preemptions": sum(r.num_preemptions for r in requests),
        "num_preemption_failed": sum(r.preemption_failed for r in requests),
        "num_output_tokens": sum(r.num_output_tokens for r in requests),
        "goodput_req_s": overall["num_slo_met"] / sim_time_s if sim_time_s > 0 else 0.0,
        "per_sla": {
            str(level): _latency_stats([r for r in requests if r.sla_level == level], slo) for level in levels
        },
        "sim_time_s": sim_time_s,
        "wall_time_s": wall_time_s,
    }
    if extra:
        summary.update(extra)
    summary["config"] = config
    return summary


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
