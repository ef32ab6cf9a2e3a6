"""Prometheus metrics of a serving engine: preemptions first, then the usual serving ones.

Owns: one `prometheus_client.CollectorRegistry` per `PreemptionMetrics` (never the global
default registry: tests run several servers in one process, and a library must not
register process-wide state), the metric definitions, and turning what the engine
exposes (`engine.stats()`, `scheduler.records`, finished requests) into samples.

It must never change the engine: it only reads. All `observe_*` calls come from the thread
that owns the engine (the server's engine thread, or the caller of `Engine.run`); only
the scrape (`render`) runs on another thread, and it reads nothing of the engine except
through callbacks on objects documented as thread-safe (the host pool's counters).

Every preemption-related metric name contains `preemption`, so
`curl .../metrics | grep preemption` finds them all (docs/design.md §5). What is counted:

- `preempt_preemptions_total{reason}`: requests taken out of the batch (`priority` or
  `memory`), exactly `engine.stats()["num_preemptions"]`; a failed attempt that kept its
  victim running is a failure, not a preemption. `preempt_preemptions_per_minute` is the
  same count over the last 60 s of wall time at scrape.
- `preempt_preemption_latency_seconds{codec}`: decision to completion of a preemption
  whose KV was moved: the engine thread's save time plus the restore time
  (`save_s + restore_s` of the record), observed when the restore ends. On the wall clock
  `save_s` is the engine thread's share (gather); the worker's encode overlaps compute.
- `preempt_preemption_resume_delay_seconds{action}`: decision to the victim's next
  scheduled step, for every preemption (queueing included), by what happened to its KV.
- `preempt_preemption_saved_kv_bytes{kind=raw|stored}`: one sample per successful save;
  the raw histogram's sum is `stats()["kv_saved_bytes_raw"]`. Stored sizes of saves
  still encoding on the worker are observed once known.

Label sets are bounded: the latency histograms' `sla_level` label takes only the levels
the config names (`slo.ttft_s`, `slo.tpot_s`, `workload.sla_mix` keys); any other level a
client sends is counted under `sla_level="other"`, so no client can grow the number of
series (each new value of a label is a new series, kept for the process's life).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from preempt.core.request import Request
    from preempt.engine.engine import Engine
    from preempt.engine.view import StepOutput
    from preempt.kv.record import PreemptionRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER_SLA_LEVEL = "other"  # the label of every SLA level the config does not name
RATE_WINDOW_S = 60.0
# Failures of the save itself: the scheduler kept no host copy (see Saver.save).
_SAVE_FAILURES = ("pool_full", "blob_too_large")

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_DELAY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(13))  # 1 KiB .. 16 GiB, x4
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_COUNT_BUCKETS = (0, 1, 2, 3, 5, 10, 20)


class PreemptionMetrics:
    """Preemption and serving metrics in their own registry.

    Use: `bind_engine(engine)` once, then `observe_step(engine, output)` after every
    step and `observe_request_done(request)` for every request that ends (finished or
    aborted, including those aborted on arrival). `render()` gives the text format.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, time_fn: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._time_fn = time_fn
        self._sla_levels: frozenset[int] = frozenset({0, 1})  # the config's, once bound
        r = self.registry

        # ---- preemption
        self.preemptions = Counter(
            "preempt_preemptions", "Requests preempted (taken out of the batch)", ["reason"], registry=r
        )
        self.preemptions_per_minute = Gauge(
            "preempt_preemptions_per_minute", "Preemptions in the last 60 s (wall time)", registry=r
        )
        self.latency = Histogram(
            "preempt_preemption_latency_seconds",
            "Decision to completion of a preemption that moved KV: save_s + restore_s",
            ["codec"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.resume_delay = Histogram(
            "preempt_preemption_resume_delay_seconds",
            "Preemption decision to the victim's next scheduled step",
            ["action"],
            buckets=_DELAY_BUCKETS,
            registry=r,
        )
        self.saved_bytes = Histogram(
            "preempt_preemption_saved_kv_bytes",
            "KV bytes of one save: raw (before the codec) and stored (in the host slot)",
            ["kind"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "preempt_preemption_failures",
            "Preemption fallbacks taken (the failure handling of docs/design.md §7), by reason",
            ["reason"],
            registry=r,
        )
        self.failed_requests = Counter(
            "preempt_preemption_failed_requests",
            "Requests marked PREEMPTION_FAILED (run to completion, never preempted again)",
            registry=r,
        )
        self.restores = Counter(
            "preempt_preemption_restores", "Saved KV restored from the host pool", ["result"], registry=r
        )
        self.restore_fallbacks = Counter(
            "preempt_preemption_restore_fallbacks",
            "Restores whose saved KV was unusable: the request was recomputed",
            registry=r,
        )
        self.reclaims = Counter(
            "preempt_preemption_reclaims",
            "Paused requests whose device blocks were reclaimed (their KV saved then)",
            registry=r,
        )
        self.stall = Counter(
            "preempt_preemption_stall_seconds",
            "Time compute waited for KV saves and restores",
            registry=r,
        )
        self.backoff = Gauge(
            "preempt_preemption_backoff_seconds",
            "Admission backoff after preemption failures still to run (0: none)",
            registry=r,
        )
        self.paused = Gauge(
            "preempt_preemption_paused_requests",
            "Preempted requests whose KV is still on the device (zero-copy pause)",
            registry=r,
        )
        self.host_pool_bytes = Gauge(
            "preempt_preemption_host_pool_bytes", "Host-pool bytes holding saved KV", registry=r
        )
        self.host_pool_peak_bytes = Gauge(
            "preempt_preemption_host_pool_peak_bytes",
            "Peak of preempt_preemption_host_pool_bytes",
            registry=r,
        )
        self.host_pool_capacity_bytes = Gauge(
            "preempt_preemption_host_pool_capacity_bytes", "Host-pool bytes for saved KV", registry=r
        )
        self.host_pool_slots_used = Gauge(
            "preempt_preemption_host_pool_slots_used",
            "Saved KV blobs held (each in its own size)",
            registry=r,
        )
        self.per_request = Histogram(
            "preempt_preemptions_per_request",
            "Preemptions a request went through, at its end",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )

        # ---- serving
        self.running = Gauge("preempt_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge("preempt_requests_waiting", "Requests queued (new and preempted)", registry=r)
        self.kv_usage = Gauge("preempt_kv_cache_usage_ratio", "Share of device KV blocks in use", registry=r)
        self.kv_blocks = Gauge("preempt_kv_cache_blocks", "Device KV blocks in the pool", registry=r)
        self.steps = Counter("preempt_engine_steps", "Engine steps that ran the model", registry=r)
        self.requests = Counter(
            "preempt_requests", "Requests ended, by final state", ["final_state"], registry=r
        )
        self.rejected = Counter(
            "preempt_requests_rejected",
            "Requests refused before reaching the engine (queue_full, backoff, shutting_down)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("preempt_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter(
            "preempt_generation_tokens", "Tokens generated by ended requests", registry=r
        )
        self.ttft = Histogram(
            "preempt_time_to_first_token_seconds",
            "Arrival to first output token",
            ["sla_level"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "preempt_time_per_output_token_seconds",
            "Mean time between output tokens after the first",
            ["sla_level"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "preempt_e2e_request_latency_seconds",
            "Arrival to the request's end",
            ["sla_level"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )

        # Known label values start at 0, so `grep preemption` shows them before any event.
        for reason in ("priority", "memory"):
            self.preemptions.labels(reason=reason)
        for reason in ("pool_full", "blob_too_large", "consecutive_limit"):
            self.failures.labels(reason=reason)
        for kind in ("raw", "stored"):
            self.saved_bytes.labels(kind=kind)
        for result in ("ok", "fallback"):
            self.restores.labels(result=result)
        for codec in ("raw", "zstd"):
            self.latency.labels(codec=codec)
        for action in ("save", "pause", "recompute"):
            self.resume_delay.labels(action=action)

        # Engine-thread state: what has been turned into samples already.
        self._num_records_seen = 0
        self._last_stats: dict[str, float] = {}
        self._awaiting_resume: dict[int, list[PreemptionRecord]] = defaultdict(list)
        self._awaiting_stored: list[PreemptionRecord] = []
        # Shared with the scrape thread (callback gauges), hence the lock.
        self._lock = threading.Lock()
        self._window: deque[float] = deque()
        self._backoff_until = 0.0  # on time_fn's clock
        self.preemptions_per_minute.set_function(self._preemptions_in_window)
        self.backoff.set_function(lambda: max(0.0, self._backoff_until - self._time_fn()))

    # ----------------------------------------------------------------- binding
    def bind_engine(self, engine: Engine) -> None:
        """Static facts and thread-safe callbacks: the host pool locks its own counters,
        so a scrape reads current bytes even while the engine sleeps (a save still
        encoding on the worker lands after the last step)."""
        self.kv_blocks.set(engine.block_pool.num_blocks)
        config = engine.config
        self._sla_levels = frozenset({*config.slo.ttft_s, *config.slo.tpot_s, *config.workload.sla_mix})
        saver = engine.saver
        if saver is None:
            return
        pool = saver.host_pool
        self.host_pool_capacity_bytes.set(pool.capacity_bytes)
        self.host_pool_bytes.set_function(lambda: pool.bytes_used)
        self.host_pool_peak_bytes.set_function(lambda: pool.peak_bytes_used)
        self.host_pool_slots_used.set_function(lambda: pool.num_used_slots)

    # ----------------------------------------------------------------- engine thread
    def observe_step(self, engine: Engine, output: StepOutput | None = None) -> None:
        """Samples from one step: new preemption records, resumed victims, counters from
        `engine.stats()`, gauges. `output` None: no step ran (e.g. after an abort)."""
        view = engine.view  # an observer: it reads the step view only
        now = view.now
        records = view.records
        for record in records[self._num_records_seen :]:
            self._observe_record(record)
        self._num_records_seen = len(records)

        if output is not None:
            resumed_at = now - output.step_s
            for chunk in output.scheduled.chunks:
                pending = self._awaiting_resume.pop(chunk.request.request_id, None)
                for record in pending or ():
                    self._observe_resume(record, resumed_at)
        self._observe_stored()
        self._observe_stats(view.stats())

        self.running.set(len(view.running))
        self.waiting.set(view.num_waiting)
        self.paused.set(view.num_paused)
        self.kv_usage.set(view.kv_usage)
        backoff_left = view.backoff_until_s - now
        with self._lock:
            self._backoff_until = self._time_fn() + backoff_left

    def observe_request_done(self, request: Request) -> None:
        """A request ended (FINISHED or ABORTED): latencies, counts, and the end of any
        preemption still waiting to resume."""
        ended = {id(record) for record in self._awaiting_resume.pop(request.request_id, ())}
        if ended:  # their saves can no longer change: observe what was stored, drop the rest
            for record in self._awaiting_stored:
                if id(record) in ended and record.bytes_stored:
                    self.saved_bytes.labels(kind="stored").observe(record.bytes_stored)
            self._awaiting_stored = [r for r in self._awaiting_stored if id(r) not in ended]
        self.requests.labels(final_state=request.state.value).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(request.num_output_tokens)
        self.per_request.observe(request.num_preemptions)
        level = self.sla_label(request.sla_level)
        if request.first_token_s is not None:
            self.ttft.labels(sla_level=level).observe(max(0.0, request.first_token_s - request.arrival_s))
            if request.finish_s is not None and request.num_output_tokens > 1:
                tpot = (request.finish_s - request.first_token_s) / (request.num_output_tokens - 1)
                self.tpot.labels(sla_level=level).observe(max(0.0, tpot))
        if request.finish_s is not None:
            self.e2e.labels(sla_level=level).observe(max(0.0, request.finish_s - request.arrival_s))

    def sla_label(self, level: int) -> str:
        """`sla_level` label value: the level if the config names it, else "other"."""
        return str(level) if level in self._sla_levels else OTHER_SLA_LEVEL

    def observe_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (any thread: Counter locks)."""
        self.rejected.labels(reason=reason).inc()

    # ----------------------------------------------------------------- scrape
    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ----------------------------------------------------------------- internals
    def _observe_record(self, record: PreemptionRecord) -> None:
        if record.is_preemption:  # exactly what scheduler.num_preemptions counts
            self.preemptions.labels(reason=record.reason).inc()
            with self._lock:
                self._window.append(self._time_fn())
            self._awaiting_resume[record.request_id].append(record)
        elif record.reason == "reclaim":
            self.reclaims.inc()
            self._awaiting_resume[record.request_id].append(record)
        if record.failure is not None:
            self.failures.labels(reason=record.failure).inc()
        if record.bytes_raw and record.failure not in _SAVE_FAILURES:
            self.saved_bytes.labels(kind="raw").observe(record.bytes_raw)
            if record.bytes_stored:
                self.saved_bytes.labels(kind="stored").observe(record.bytes_stored)
            else:  # still encoding on the saver's worker thread
                self._awaiting_stored.append(record)

    def _observe_resume(self, record: PreemptionRecord, resumed_at: float) -> None:
        if record.reason != "reclaim":  # a reclaim continues an earlier pause, counted there
            self.resume_delay.labels(action=record.action).observe(max(0.0, resumed_at - record.time_s))
        if record.restored is not None:
            self.restores.labels(result="ok" if record.restored else "fallback").inc()
            self.latency.labels(codec=record.codec or "none").observe(record.save_s + record.restore_s)

    def _observe_stored(self) -> None:
        still: list[PreemptionRecord] = []
        for record in self._awaiting_stored:
            if record.bytes_stored:
                self.saved_bytes.labels(kind="stored").observe(record.bytes_stored)
            elif record.restored is None:
                still.append(record)
            # else: restored without a stored size: the worker lost the save (recomputed)
        self._awaiting_stored = still

    def _observe_stats(self, stats: dict[str, float]) -> None:
        for key, counter in (
            ("num_steps", self.steps),
            ("num_preemption_failed", self.failed_requests),
            ("num_restore_fallbacks", self.restore_fallbacks),
            ("preemption_stall_s", self.stall),
        ):
            delta = stats[key] - self._last_stats.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._last_stats = dict(stats)

    def _preemptions_in_window(self) -> float:
        with self._lock:
            cutoff = self._time_fn() - RATE_WINDOW_S
            while self._window and self._window[0] <= cutoff:
                self._window.popleft()
            return float(len(self._window))
