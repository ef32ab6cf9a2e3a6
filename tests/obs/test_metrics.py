"""Preemption metrics agree with the engine's own counts: in-process on the virtual clock
(deterministic, every mode), and through a live server's /metrics on the wall clock."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from preempt.core.request import Request
from preempt.engine.engine import Engine
from preempt.engine.view import StepOutput
from preempt.kv.record import PreemptionRecord
from preempt.obs.metrics import PreemptionMetrics
from tests.conftest import make_request, small_config
from tests.serve.conftest import running_server, serve_config, wait_for

AGGRESSIVE = {
    "min_time_slice_ms": 0.0,
    "time_slices": {"long_ms": 5.0, "medium_ms": 5.0, "short_ms": 5.0, "static_ms": 5.0},
    "max_preemption_per_min": None,
    "max_consecutive_preemptions": 100,
}
SAVE_FAILURES = ("pool_full", "blob_too_large")


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a sample over every label set that contains `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _workload() -> list[Request]:
    # Eight long level-0 requests fill the batch; a VIP arrives every 15 ms.
    background = [make_request(i, 8 + (i * 13) % 33, 30 + i) for i in range(8)]
    vips = [
        make_request(8 + k, 5 + (k * 7) % 30, 4 + k % 7, arrival_s=0.02 + 0.015 * k, sla_level=1)
        for k in range(12)
    ]
    return background + vips


def _replay(**preemption: Any) -> tuple[Engine, PreemptionMetrics, list[Request]]:
    num_blocks = preemption.pop("num_blocks", 256)
    config = small_config(
        # One torch thread: on 2 busy cores, OpenMP threads stall at every barrier (150x).
        model={"num_threads": 1},
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={**AGGRESSIVE, **preemption},
    )
    engine = Engine(config)
    metrics = PreemptionMetrics()
    metrics.bind_engine(engine)

    def on_step(output: StepOutput) -> None:
        metrics.observe_step(engine, output)
        for request in output.finished:
            metrics.observe_request_done(request)

    requests = _workload()
    engine.run(requests, on_step=on_step)
    engine.close()
    return engine, metrics, requests


def assert_agrees(samples: dict, stats: dict, records: Iterable[PreemptionRecord]) -> None:
    records = list(records)
    preempted = [
        r for r in records if r.reason == "memory" or (r.reason == "priority" and r.action != "none")
    ]
    assert total(samples, "preempt_preemptions_total") == stats["num_preemptions"] == len(preempted)
    for reason in ("priority", "memory"):
        expected = sum(r.reason == reason for r in preempted)
        assert total(samples, "preempt_preemptions_total", reason=reason) == expected
    for failure in ("pool_full", "blob_too_large", "consecutive_limit"):
        expected = sum(r.failure == failure for r in records)
        assert total(samples, "preempt_preemption_failures_total", reason=failure) == expected
    assert total(samples, "preempt_preemption_failed_requests_total") == stats["num_preemption_failed"]
    assert total(samples, "preempt_preemption_restore_fallbacks_total") == stats["num_restore_fallbacks"]

    saves = [r for r in records if r.bytes_raw and r.failure not in SAVE_FAILURES]
    assert total(samples, "preempt_preemption_saved_kv_bytes_count", kind="raw") == len(saves)
    assert total(samples, "preempt_preemption_saved_kv_bytes_sum", kind="raw") == stats["kv_saved_bytes_raw"]
    assert total(samples, "preempt_preemption_saved_kv_bytes_sum", kind="stored") == sum(
        r.bytes_stored for r in saves
    )
    restored = [r for r in records if r.restored is not None]
    assert total(samples, "preempt_preemption_latency_seconds_count") == len(restored)
    assert total(samples, "preempt_preemption_latency_seconds_sum") == pytest.approx(
        sum(r.save_s + r.restore_s for r in restored)
    )
    assert total(samples, "preempt_preemption_restores_total", result="ok") == sum(
        r.restored for r in restored
    )
    assert total(samples, "preempt_preemption_host_pool_bytes") == 0  # everything restored or freed


@pytest.mark.parametrize(
    "preemption",
    [
        {"mode": "swap"},
        {"mode": "swap_zstd"},
        {"mode": "pause", "num_blocks": 30},  # reclaims: paused KV saved when blocks run out
        {"mode": "recompute"},
        {"mode": "swap", "host_mem": "64KB", "slot_size": "64KB"},  # pool_full fallbacks
    ],
    ids=["swap", "swap_zstd", "pause-reclaim", "recompute", "pool-full"],
)
def test_metrics_agree_with_the_engine(preemption: dict[str, Any]) -> None:
    engine, metrics, requests = _replay(**preemption)
    records = engine.scheduler.records
    assert engine.scheduler.num_preemptions > 0, "the workload must preempt"
    samples = parse(metrics.render().decode())
    assert_agrees(samples, engine.stats(), records)

    # Every preempted request resumed before finishing: one resume delay per preemption.
    assert total(samples, "preempt_preemption_resume_delay_seconds_count") == engine.scheduler.num_preemptions
    assert total(samples, "preempt_preemptions_per_request_sum") == sum(r.num_preemptions for r in requests)
    assert total(samples, "preempt_preemptions_per_minute") == engine.scheduler.num_preemptions
    assert total(samples, "preempt_requests_total", final_state="FINISHED") == len(requests)
    assert total(samples, "preempt_time_to_first_token_seconds_count") == len(requests)
    assert total(samples, "preempt_generation_tokens_total") == sum(r.num_output_tokens for r in requests)
    assert total(samples, "preempt_engine_steps_total") == engine.num_steps
    if preemption["mode"] == "pause":
        assert total(samples, "preempt_preemption_reclaims_total") == sum(
            r.reason == "reclaim" for r in records
        )
    if "host_mem" in preemption:
        assert total(samples, "preempt_preemption_failures_total", reason="pool_full") > 0


def test_every_preemption_metric_is_named_for_grep() -> None:
    # docs/design.md §5: `curl .../metrics | grep preemption` shows count, rate, latency, saved size.
    text = PreemptionMetrics().render().decode()
    lines = [line for line in text.splitlines() if "preemption" in line and not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in lines}
    for name in (
        "preempt_preemptions_total",
        "preempt_preemptions_per_minute",
        "preempt_preemption_latency_seconds_count",
        "preempt_preemption_saved_kv_bytes_bucket",
        "preempt_preemption_failures_total",
        "preempt_preemption_restores_total",
        "preempt_preemption_restore_fallbacks_total",
        "preempt_preemption_host_pool_bytes",
    ):
        assert name in names, name
    assert 'preempt_preemptions_total{reason="priority"} 0.0' in text  # zero before any event


def test_registries_are_independent() -> None:
    a, b = PreemptionMetrics(), PreemptionMetrics()
    a.preemptions.labels(reason="priority").inc()
    assert total(parse(b.render().decode()), "preempt_preemptions_total") == 0


def test_live_server_metrics_agree_with_the_engine() -> None:
    # Two long requests fill both seats; VIPs then arrive while the batch is full and
    # displace them (priority_score, 2 ms slices, swap to host).
    config = serve_config(
        scheduler={"max_num_seqs": 2, "policy": "priority_score"},
        preemption={
            "mode": "swap",
            "min_time_slice_ms": 0.0,
            "time_slices": {"long_ms": 2.0, "medium_ms": 2.0, "short_ms": 2.0, "static_ms": 2.0},
            "max_preemption_per_min": None,
        },
    )
    with running_server(config) as live, ThreadPoolExecutor(8) as pool:

        def generate(body: dict[str, Any]) -> dict[str, Any]:
            response = httpx.post(f"{live.url}/generate", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

        background = [
            pool.submit(generate, {"prompt": f"background {i} " * 4, "max_tokens": 300}) for i in range(2)
        ]
        assert wait_for(lambda: live.on_engine(lambda e: len(e.scheduler.running)) == 2)
        vips = [
            pool.submit(generate, {"prompt": f"vip {k}", "max_tokens": 20, "sla_level": 3}) for k in range(4)
        ]
        results = [f.result(timeout=120) for f in background + vips]
        assert all(r["final_state"] == "FINISHED" for r in results)
        assert sum(r["num_preemptions"] for r in results) > 0, "the VIPs must preempt"

        samples = parse(httpx.get(f"{live.url}/metrics", timeout=10).text)
        stats, records = live.on_engine(lambda e: (e.stats(), list(e.scheduler.records)))
        assert_agrees(samples, stats, records)
        assert total(samples, "preempt_preemptions_total") == sum(r["num_preemptions"] for r in results)
        assert total(samples, "preempt_requests_total", final_state="FINISHED") == len(results)
        assert total(samples, "preempt_preemptions_per_minute") == stats["num_preemptions"]
        assert total(samples, "preempt_requests_running") == 0
        assert total(samples, "preempt_kv_cache_usage_ratio") == 0


def test_sla_level_labels_are_bounded_by_the_config() -> None:
    """1,000 distinct client SLA levels add no series: unknown levels fold into "other"."""
    engine = Engine(small_config(model={"backend": "null"}))
    metrics = PreemptionMetrics()
    metrics.bind_engine(engine)

    def finish(request: Request) -> None:
        request.first_token_s, request.finish_s = 0.01, 0.05
        request.output_token_ids = [1, 2, 3]
        metrics.observe_request_done(request)

    finish(make_request(0, 4, 3, sla_level=0))
    finish(make_request(1, 4, 3, sla_level=1))
    before = metrics.render()
    for level in range(2, 1002):
        finish(make_request(level, 4, 3, sla_level=level))
    after = metrics.render()
    # One new label value ("other") per SLA histogram, whatever the number of levels sent.
    assert len(after.splitlines()) - len(before.splitlines()) < 100
    samples = parse(after.decode())
    assert total(samples, "preempt_e2e_request_latency_seconds_count", sla_level="other") == 1000
    assert total(samples, "preempt_e2e_request_latency_seconds_count", sla_level="1") == 1
    levels = {dict(ls).get("sla_level") for (_, ls) in samples} - {None}
    assert levels == {"0", "1", "other"}
