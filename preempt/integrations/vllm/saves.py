"""Whom the KV connector saves, and whom it copies early: the plugin's decisions, in plain Python.

`SavePlanner` is the connector's `SaveAdvisor` (connector.py), made by `PreemptScheduler`:
- `should_save`: every victim (`saves: all`), or (`saves: cost`) a victim only while
  copying a token out and back is measured to cost less than recomputing it, InferCept's
  choice by waste (Abhyankar et al., ICML 2024) with both sides measured on this server:
  save and load seconds per token from the connector's reports, prefill seconds per token
  from the steps that were mostly prefill. Until both are measured, it saves.
- `early_targets`: the projection of vLLM's memory preemptions over the next
  `early_horizon_steps` decode steps. Each running request grows by one token a step
  until its expected output is done (`RequestView.expected_output_left`, else what its
  `max_tokens` leaves); when the new blocks that needs exceed the free blocks, the
  policy's victim order (`PreemptionDecider.memory_victim_order`, the order the plugin
  gives vLLM) names the requests whose blocks cover the deficit. Those are copied now,
  so at the preemption only the tokens since are.
It never imports vLLM and never touches a request: the connector acts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from preempt.core.block_pool import blocks_needed
from preempt.integrations.vllm.decider import PreemptionDecider, RequestView
from preempt.integrations.vllm.kv_store import ConnectorSettings
from preempt.integrations.vllm.metrics import ConnectorMetrics

EMA = 0.2  # weight of the newest measurement
MIN_PREFILL_TOKENS = 64  # a step with fewer tokens is decode-bound: not a prefill measurement


class _Rate:
    """An exponential moving average of seconds per token."""

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        rate = seconds / num_tokens
        self.value = rate if self.value is None else (1 - EMA) * self.value + EMA * rate


class SavePlanner:
    def __init__(
        self,
        decider: PreemptionDecider,
        settings: ConnectorSettings,
        block_size: int,
        state: Callable[[], tuple[Sequence[RequestView], int, float]],
        metrics: ConnectorMetrics | None = None,
    ) -> None:
        """`state()`: the running requests' views, the free KV blocks, and now; `metrics`:
        the connector's, where the cost rule's choices and prefill measurements are counted."""
        self.metrics = metrics
        self.decider = decider
        self.settings = settings
        self.block_size = block_size
        self.state = state
        self.save_rate, self.load_rate, self.prefill_rate = _Rate(), _Rate(), _Rate()

    # ------------------------------------------------------------- measurements
    def observe_save(self, num_tokens: int, seconds: float) -> None:
        self.save_rate.add(num_tokens, seconds)

    def observe_load(self, num_tokens: int, seconds: float) -> None:
        self.load_rate.add(num_tokens, seconds)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_rate.add(num_tokens, seconds)
            if self.metrics is not None:
                self.metrics.prefill_tokens += num_tokens
                self.metrics.prefill_s += seconds

    # ------------------------------------------------------------- decisions
    def should_save(self, request_id: str, num_tokens: int) -> bool:
        if self.settings.saves == "all":
            return True
        rates = (self.save_rate.value, self.load_rate.value, self.prefill_rate.value)
        if None in rates:
            choice = "unmeasured"
        else:
            save, load, prefill = rates
            choice = "save" if save + load < prefill else "recompute"
        if self.metrics is not None:
            self.metrics.cost_choices[choice] += 1
        return choice != "recompute"

    def early_targets(self, tables: dict[str, tuple[list[int], int]]) -> list[str]:
        running, free_blocks, now = self.state()
        horizon = self.settings.early_horizon_steps
        needs = {}
        for view in running:
            left = view.expected_output_left
            if left is None:
                left = max(view.max_tokens - view.num_output_tokens, 0)
            held, grow = view.num_computed_tokens, min(horizon, int(left))
            needs[view.request_id] = blocks_needed(held + grow, self.block_size) - blocks_needed(
                held, self.block_size
            )
        deficit = sum(needs.values()) - free_blocks
        targets = []
        for view in self.decider.memory_victim_order(running, now) if deficit > 0 else ():
            if deficit <= 0:
                break
            targets.append(view.request_id)
            # a victim gives back its blocks and no longer needs new ones
            deficit -= blocks_needed(view.num_computed_tokens, self.block_size) + needs[view.request_id]
        return [request_id for request_id in targets if request_id in tables]
