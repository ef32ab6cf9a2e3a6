"""The plugin's preemption metrics: counts by reason, fallbacks, recomputed tokens, stall.

Plain counters here (`PluginMetrics.snapshot()` is what the bench and tests read). The
scheduler runs in vLLM's engine-core process, while `/metrics` is served by the API
server, another process; two routes get the counters there (`COUNTERS` names them, as
vLLM's are `vllm:*`):

- `PrometheusExport`: prometheus_client counters made in the engine core. They reach
  `/metrics` when PROMETHEUS_MULTIPROC_DIR is set, which `vllm serve` does itself only
  with `--api-server-count` > 1 (vllm/entrypoints/cli/serve.py), and in one process
  (`vllm.LLM` in-process, as `preempt bench vllm` reads them).
- `SnapshotWriter` -> `SnapshotCollector`: with vLLM's default single API server, the
  engine core writes its counters to a small JSON file whenever they change, in a
  directory named by its parent's pid (the API server that started it), and a collector
  that preempt's stat-logger plugin registers in the API server (`stat_logger.py`, an
  entry point vLLM loads by itself) reads them at scrape time. No variable to set.

Two sets travel these routes: the scheduler's (`PLUGIN`: `PluginMetrics`, counters) and
the KV connector's (`CONNECTOR`: `ConnectorMetrics`, counters and two latency
histograms), each in its own snapshot file per engine core.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REASONS = ("priority", "memory", "other")

# (family, help, label or None, `PluginMetrics.snapshot()` key): both routes export these.
COUNTERS = (
    ("preempt:preemptions", "Preemptions by the preempt plugin, by reason", "reason", "preemptions"),
    ("preempt:preemption_failures", "Fallbacks taken, by reason", "failure", "failures"),
    ("preempt:recomputed_tokens", "KV tokens dropped by preemptions", None, "recomputed_tokens"),
    ("preempt:preemption_stall_seconds", "Time preempted requests waited to resume", None, "stall_s"),
    ("preempt:rate_limited", "Priority preemptions refused by the rate cap", None, "rate_limited"),
)


@dataclass
class PluginMetrics:
    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    """`priority`: displaced by a waiting request; `memory`: KV blocks ran out (vLLM's own
    trigger, victim chosen by the policy); `other`: vLLM preempted outside schedule()
    (e.g. a prefix-cache reset)."""
    failures: dict[str, int] = field(default_factory=lambda: {"consecutive_limit": 0})
    """Fallbacks taken, by reason: only `consecutive_limit` (vLLM never fails a save),
    present at 0 so that `/metrics` shows the family before the first one."""
    num_preemption_failed: int = 0
    """Requests marked PREEMPTION_FAILED (protected, run to completion)."""
    rate_limited: int = 0
    """Steps whose priority preemption the rate cap refused."""
    recomputed_tokens: int = 0
    """Tokens of KV dropped by preemptions (vLLM recomputes them on resume)."""
    stall_s: float = 0.0
    """Time preempted requests spent out of the batch until resumed (plugin clock)."""

    def on_preemption(self, reason: str, num_tokens_dropped: int) -> None:
        self.preemptions[reason] = self.preemptions.get(reason, 0) + 1
        self.recomputed_tokens += num_tokens_dropped

    def on_failure(self, failure: str) -> None:
        self.failures[failure] = self.failures.get(failure, 0) + 1

    def snapshot(self) -> dict:
        return {
            "preemptions": dict(self.preemptions),
            "num_preemptions": sum(self.preemptions.values()),
            "failures": dict(self.failures),
            "num_preemption_failed": self.num_preemption_failed,
            "rate_limited": self.rate_limited,
            "recomputed_tokens": self.recomputed_tokens,
            "stall_s": self.stall_s,
        }


# Save and load latencies, seconds: a copy of a few MB encodes in milliseconds on a CPU.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONNECTOR_COUNTERS = (
    ("preempt:kv_saves", "Preempted requests whose KV the connector stored in the host pool", None, "saves"),
    (
        "preempt:kv_loads",
        "Resumed requests whose KV the connector loaded instead of recomputing",
        None,
        "loads",
    ),
    (
        "preempt:kv_fallbacks",
        "Preempted requests recomputed instead of loaded, by reason",
        "reason",
        "fallbacks",
    ),
    ("preempt:kv_stored_bytes", "Bytes of the copies stored in the host pool", None, "stored_bytes"),
    ("preempt:kv_raw_bytes", "KV bytes of those copies before encoding", None, "raw_bytes"),
    ("preempt:kv_preempted_tokens", "Tokens of KV the preempted requests held", None, "preempted_tokens"),
    (
        "preempt:kv_loaded_tokens",
        "Tokens loaded from the host pool: recomputation avoided",
        None,
        "loaded_tokens",
    ),
    ("preempt:kv_early_tokens", "Tokens copied ahead of a predicted preemption", None, "early_tokens"),
    (
        "preempt:kv_early_wasted",
        "Requests copied ahead that finished without being preempted",
        None,
        "early_wasted",
    ),
    (
        "preempt:kv_resume_waits",
        "Steps a preempted request could have resumed but its copy was still being stored",
        None,
        "resume_waits",
    ),
    ("preempt:kv_saved_tokens", "Tokens of KV in the copies stored in the host pool", None, "saved_tokens"),
    (
        "preempt:kv_cost_choices",
        "saves: cost, each victim's choice: save, recompute, or save while unmeasured",
        "choice",
        "cost_choices",
    ),
    (
        "preempt:kv_prefill_tokens",
        "Tokens of the prefill-bound steps the cost rule measures recomputing on",
        None,
        "prefill_tokens",
    ),
    ("preempt:kv_prefill_seconds", "Seconds of those steps", None, "prefill_s"),
)
CONNECTOR_HISTOGRAMS = (
    ("preempt:kv_save_seconds", "From a preemption to its copy stored (gather, encode, store)", "save_s"),
    ("preempt:kv_load_seconds", "Decoding a copy into the resumed request's blocks", "load_s"),
)
FALLBACKS = ("pool_full", "blob_too_large", "corrupt", "load", "encode", "cost", "prefix_cache")
COST_CHOICES = ("save", "recompute", "unmeasured")


@dataclass
class ConnectorMetrics:
    """The KV connector's counters (scheduler side: it sees every save's and load's report)."""

    saves: int = 0
    loads: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACKS, 0))
    """`pool_full`, `blob_too_large`: the host pool refused the copy; `corrupt`: a copy
    failed its checksum on load; `load`: its load failed otherwise; `encode`: the codec
    failed; `cost`: the plugin chose to recompute (`saves: cost`); `prefix_cache`: vLLM's
    prefix cache held the whole copy."""
    stored_bytes: int = 0
    raw_bytes: int = 0
    preempted_tokens: int = 0
    loaded_tokens: int = 0
    early_tokens: int = 0
    early_wasted: int = 0
    resume_waits: int = 0
    """vLLM asked to resume a victim whose store was in flight: told to ask again next step
    (vLLM #46014's case: never admitted on a half-stored copy)."""
    saved_tokens: int = 0
    cost_choices: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COST_CHOICES, 0))
    """`saves: cost`: victims saved because copying was measured cheaper (`save`), recomputed
    because it was not (`recompute`), saved before both sides were measured (`unmeasured`)."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    save_s: dict = field(default_factory=lambda: empty_histogram())
    load_s: dict = field(default_factory=lambda: empty_histogram())
    observed: list[tuple[str, float]] = field(default_factory=list)
    """Latencies not yet given to prometheus_client histograms (`PrometheusExport`)."""

    def preempted(self, num_tokens: int) -> None:
        self.preempted_tokens += num_tokens

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def stored(self, report) -> None:
        self.saves += 1
        self.saved_tokens += report.num_tokens
        self.stored_bytes += report.stored_bytes
        self.raw_bytes += report.raw_bytes
        self._observe("save_s", report.seconds)

    def loaded(self, report) -> None:
        if report.error is not None:
            self.fallback(report.error)
            return
        self.loads += 1
        self.loaded_tokens += report.num_tokens
        self._observe("load_s", report.seconds)

    def _observe(self, key: str, seconds: float) -> None:
        hist = getattr(self, key)
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                hist["buckets"][i] += 1
        hist["buckets"][-1] += 1
        hist["sum"] += seconds
        self.observed.append((key, seconds))

    def snapshot(self) -> dict:
        out = {key: getattr(self, key) for _, _, _, key in CONNECTOR_COUNTERS}
        out["fallbacks"] = dict(self.fallbacks)
        out["cost_choices"] = dict(self.cost_choices)
        for _, _, key in CONNECTOR_HISTOGRAMS:
            hist = getattr(self, key)
            out[key] = {"buckets": list(hist["buckets"]), "sum": hist["sum"]}
        return out

    def take_observed(self) -> list[tuple[str, float]]:
        observed, self.observed = self.observed, []
        return observed


def empty_histogram() -> dict:
    """Cumulative counts per `LATENCY_BUCKETS` bound (Prometheus' `le`), then +Inf; the sum."""
    return {"buckets": [0] * (len(LATENCY_BUCKETS) + 1), "sum": 0.0}


@dataclass(frozen=True)
class MetricSet:
    """One set of families on `/metrics`: counters `(family, help, label, key)`,
    histograms `(family, help, key)`, the snapshot of no events, and its file's prefix."""

    counters: tuple
    histograms: tuple
    empty: object  # () -> snapshot
    prefix: str


PLUGIN = MetricSet(COUNTERS, (), lambda: PluginMetrics().snapshot(), "engine")
CONNECTOR = MetricSet(
    CONNECTOR_COUNTERS, CONNECTOR_HISTOGRAMS, lambda: ConnectorMetrics().snapshot(), "connector"
)


_process_metrics: dict[str, dict] = {}


def _prometheus(metric_set: MetricSet) -> dict:
    """A set's families as prometheus_client metrics, made once per process (a registry
    holds one timeseries per name: a second scheduler in the process adds to them)."""
    if metric_set.prefix not in _process_metrics:
        from prometheus_client import Counter, Histogram

        made = {
            key: Counter(name, doc, [label] if label else []) for name, doc, label, key in metric_set.counters
        }
        for name, doc, key in metric_set.histograms:
            made[key] = Histogram(name, doc, buckets=LATENCY_BUCKETS)
        _process_metrics[metric_set.prefix] = made
    return _process_metrics[metric_set.prefix]


class PrometheusExport:
    """prometheus_client metrics mirroring a set (`PLUGIN` by default). `sync()` pushes
    the counters' deltas since the last call; histograms get the new observations."""

    def __init__(self, metric_set: MetricSet = PLUGIN) -> None:
        self.metric_set = metric_set
        self._metrics = _prometheus(metric_set)
        self._labels = {key: label for _, _, label, key in metric_set.counters}
        self._last = metric_set.empty()

    def sync(self, now: dict, observed: list[tuple[str, float]] = ()) -> None:
        for key, label in self._labels.items():
            counter = self._metrics[key]
            if label is None:
                delta = now[key] - self._last[key]
                if delta > 0:
                    counter.inc(delta)
                continue
            for value, count in now[key].items():
                delta = count - self._last[key].get(value, 0)
                if delta:
                    counter.labels(**{label: value}).inc(delta)
        for key, seconds in observed:
            self._metrics[key].observe(seconds)
        self._last = now


def snapshot_dir(api_server_pid: int) -> Path:
    """Where the engine cores started by process `api_server_pid` leave their counters."""
    return Path(tempfile.gettempdir()) / f"preempt-vllm-metrics-{os.getuid()}" / str(api_server_pid)


class SnapshotWriter:
    """In the engine core: a set's snapshot to `<snapshot_dir(parent)>/<prefix>-<pid>.json`,
    atomically (write, then rename), and only when it changed."""

    def __init__(self, directory: Path | None = None, metric_set: MetricSet = PLUGIN) -> None:
        self.directory = directory or snapshot_dir(os.getppid())
        self.path = self.directory / f"{metric_set.prefix}-{os.getpid()}.json"
        self._last: dict | None = None

    def write(self, snapshot: dict) -> None:
        if snapshot == self._last:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(snapshot))
            os.replace(partial, self.path)
        except OSError:
            return  # metrics are best effort: never stop the engine for them
        self._last = snapshot


class ConnectorMetricsExport:
    """The connector's metrics on both routes, synced once per step."""

    def __init__(self) -> None:
        self._prometheus = PrometheusExport(CONNECTOR)
        self._snapshots = SnapshotWriter(metric_set=CONNECTOR)

    def sync(self, metrics: ConnectorMetrics) -> None:
        snapshot = metrics.snapshot()
        self._prometheus.sync(snapshot, metrics.take_observed())
        self._snapshots.write(snapshot)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(directory: Path, metric_set: MetricSet = PLUGIN) -> dict | None:
    """A set's snapshots from every live engine core that wrote to `directory`, summed (a
    dead one's file is from an earlier server whose pid this one reuses); None if none."""
    total = metric_set.empty()
    found = False
    for path in sorted(directory.glob(f"{metric_set.prefix}-*.json")):
        try:
            if not _alive(int(path.stem.removeprefix(f"{metric_set.prefix}-"))):
                continue
            snapshot = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced between glob and read, or not a snapshot: skip
        found = True
        for _, _, label, key in metric_set.counters:
            if label is None:
                total[key] += snapshot.get(key, 0)
            else:
                for value, count in snapshot.get(key, {}).items():
                    total[key][value] = total[key].get(value, 0) + count
        for _, _, key in metric_set.histograms:
            theirs = snapshot.get(key, {})
            buckets = theirs.get("buckets", [0] * len(total[key]["buckets"]))
            total[key]["buckets"] = [a + b for a, b in zip(total[key]["buckets"], buckets, strict=True)]
            total[key]["sum"] += theirs.get("sum", 0.0)
    return total if found else None


class SnapshotCollector:
    """A prometheus_client collector in the API server: each set's families from the
    engine cores' snapshot files, read at each scrape; nothing for a set no engine core
    wrote (a plain vLLM scheduler writes none). The directory goes at exit."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or snapshot_dir(os.getpid())
        atexit.register(shutil.rmtree, self.directory, True)

    def describe(self) -> list:
        # Nothing to declare: in one process (vllm.LLM in-process) PrometheusExport's
        # metrics of the same names are already registered and this reads no files.
        return []

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        if not self.directory.is_dir():
            return
        for metric_set in (PLUGIN, CONNECTOR):
            total = read_snapshots(self.directory, metric_set)
            if total is None:
                continue
            for name, doc, label, key in metric_set.counters:
                family = CounterMetricFamily(name, doc, labels=[label] if label else None)
                if label is None:
                    family.add_metric([], total[key])
                else:
                    for value, count in sorted(total[key].items()):
                        family.add_metric([value], count)
                yield family
            for name, doc, key in metric_set.histograms:
                hist = total[key]
                bounds = [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
                family = HistogramMetricFamily(name, doc)
                family.add_metric([], list(zip(bounds, hist["buckets"], strict=True)), sum_value=hist["sum"])
                yield family
