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
    ("preempt:saved_bytes", "KV bytes saved instead of dropped", None, "saved_bytes"),
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
    saved_bytes: int = 0
    """KV bytes saved instead of dropped: always 0, vLLM 0.32's scheduler preempts by
    recompute only (docs/vllm_plugin.md: KV offloading)."""

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
            "saved_bytes": self.saved_bytes,
        }


_process_counters: dict | None = None


def _counters() -> dict:
    """The `COUNTERS` as prometheus_client counters, made once per process (a registry
    holds one timeseries per name: a second scheduler in the process adds to them)."""
    global _process_counters
    if _process_counters is None:
        from prometheus_client import Counter

        _process_counters = {
            key: Counter(name, doc, [label] if label else []) for name, doc, label, key in COUNTERS
        }
    return _process_counters


class PrometheusExport:
    """prometheus_client counters mirroring `PluginMetrics` (`COUNTERS`). `sync()` pushes
    the deltas of a `PluginMetrics.snapshot()` since the last call."""

    def __init__(self) -> None:
        self._counters = _counters()
        self._labels = {key: label for _, _, label, key in COUNTERS}
        self._last = PluginMetrics().snapshot()

    def sync(self, now: dict) -> None:
        for key, counter in self._counters.items():
            label = self._labels[key]
            if label is None:
                delta = now[key] - self._last[key]
                if delta > 0:
                    counter.inc(delta)
                continue
            for value, count in now[key].items():
                delta = count - self._last[key].get(value, 0)
                if delta:
                    counter.labels(**{label: value}).inc(delta)
        self._last = now


def snapshot_dir(api_server_pid: int) -> Path:
    """Where the engine cores started by process `api_server_pid` leave their counters."""
    return Path(tempfile.gettempdir()) / f"preempt-vllm-metrics-{os.getuid()}" / str(api_server_pid)


class SnapshotWriter:
    """In the engine core: `PluginMetrics.snapshot()` to `<snapshot_dir(parent)>/engine-<pid>
    .json`, atomically (write, then rename), and only when it changed."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or snapshot_dir(os.getppid())
        self.path = self.directory / f"engine-{os.getpid()}.json"
        self._last: dict | None = None

    def write(self, snapshot: dict) -> None:
        """`snapshot`: a `PluginMetrics.snapshot()`."""
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(directory: Path) -> dict:
    """The counters of every live engine core that wrote to `directory`, summed (a dead
    one's file is from an earlier server whose pid this one reuses)."""
    total = PluginMetrics().snapshot()
    for path in sorted(directory.glob("engine-*.json")):
        try:
            if not _alive(int(path.stem.removeprefix("engine-"))):
                continue
            snapshot = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced between glob and read, or not a snapshot: skip
        for _, _, label, key in COUNTERS:
            if label is None:
                total[key] += snapshot.get(key, 0)
            else:
                for value, count in snapshot.get(key, {}).items():
                    total[key][value] = total[key].get(value, 0) + count
    return total


class SnapshotCollector:
    """A prometheus_client collector in the API server: the `COUNTERS` families from the
    engine cores' snapshot files, read at each scrape; nothing while there are none (a
    plain vLLM scheduler writes none). The directory goes at exit."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or snapshot_dir(os.getpid())
        atexit.register(shutil.rmtree, self.directory, True)

    def describe(self) -> list:
        # Nothing to declare: in one process (vllm.LLM in-process) PrometheusExport's
        # counters of the same names are already registered and this reads no files.
        return []

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        if not self.directory.is_dir() or not any(self.directory.glob("engine-*.json")):
            return
        total = read_snapshots(self.directory)
        for name, doc, label, key in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=[label] if label else None)
            if label is None:
                family.add_metric([], total[key])
            else:
                for value, count in sorted(total[key].items()):
                    family.add_metric([value], count)
            yield family
