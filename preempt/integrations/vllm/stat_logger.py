"""`PreemptStatLogger`: puts the plugin's counters on `vllm serve`'s `/metrics`.

vLLM loads it by itself, in the API server process, from preempt's entry point in the
`vllm.stat_logger_plugins` group (pyproject.toml); preempt must be pip-installed into
vLLM's environment for that (`make peer` does: `pip install --no-deps -e .`). It logs
nothing; it registers a `SnapshotCollector` that reads, at each scrape, the counters the
engine-core processes this server started wrote (`metrics.py`). With
PROMETHEUS_MULTIPROC_DIR set (vLLM's own with `--api-server-count` > 1, or a user's),
`/metrics` collects the engine core's prometheus_client counters from that directory
instead, so the collector stays out of the way. Imports vLLM.
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY
from vllm.v1.metrics.loggers import StatLoggerBase

from preempt.integrations.vllm.metrics import SnapshotCollector

_collector: SnapshotCollector | None = None


def register_collector() -> SnapshotCollector | None:
    """Once per process; None where PROMETHEUS_MULTIPROC_DIR routes the counters."""
    global _collector
    if _collector is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None:
        _collector = SnapshotCollector()
        REGISTRY.register(_collector)
    return _collector


class PreemptStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        register_collector()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        pass  # the counters come from the engine core's snapshots, not per-step stats

    def log_engine_initialized(self) -> None:
        pass
