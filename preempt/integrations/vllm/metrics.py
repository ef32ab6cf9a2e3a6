"""The plugin's preemption metrics: counts by reason, fallbacks, recomputed tokens, stall.

Plain counters here (`PluginMetrics.snapshot()` is what the bench and tests read); in a
vLLM server they are also exported through prometheus_client (`PrometheusExport`), which
vLLM's API server shows on its own `/metrics` beside `vllm:num_preemptions_total`: `vllm
serve` sets PROMETHEUS_MULTIPROC_DIR before it starts the engine-core process, so
counters made there are collected with vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REASONS = ("priority", "memory", "other")


@dataclass
class PluginMetrics:
    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    """`priority`: displaced by a waiting request; `memory`: KV blocks ran out (vLLM's own
    trigger, victim chosen by the policy); `other`: vLLM preempted outside schedule()
    (e.g. a prefix-cache reset)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Fallbacks taken, by reason (`consecutive_limit`: vLLM never fails a save)."""
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


class PrometheusExport:
    """prometheus_client collectors mirroring `PluginMetrics` (names `preempt:*`, as
    vLLM's are `vllm:*`). `sync()` pushes the deltas since the last call."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self._preemptions = Counter(
            "preempt:preemptions", "Preemptions by the preempt plugin, by reason", ["reason"]
        )
        self._failures = Counter("preempt:preemption_failures", "Fallbacks taken, by reason", ["failure"])
        self._recomputed = Counter("preempt:recomputed_tokens", "KV tokens dropped by preemptions")
        self._stall = Counter("preempt:preemption_stall_seconds", "Time preempted requests waited to resume")
        self._rate_limited = Counter("preempt:rate_limited", "Priority preemptions refused by the rate cap")
        self._saved = Counter("preempt:saved_bytes", "KV bytes saved instead of dropped")
        self._last = PluginMetrics().snapshot()

    def sync(self, metrics: PluginMetrics) -> None:
        now = metrics.snapshot()
        for reason, count in now["preemptions"].items():
            delta = count - self._last["preemptions"].get(reason, 0)
            if delta:
                self._preemptions.labels(reason=reason).inc(delta)
        for failure, count in now["failures"].items():
            delta = count - self._last["failures"].get(failure, 0)
            if delta:
                self._failures.labels(failure=failure).inc(delta)
        for counter, key in (
            (self._recomputed, "recomputed_tokens"),
            (self._stall, "stall_s"),
            (self._rate_limited, "rate_limited"),
            (self._saved, "saved_bytes"),
        ):
            delta = now[key] - self._last[key]
            if delta > 0:
                counter.inc(delta)
        self._last = now
