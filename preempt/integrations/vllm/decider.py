"""What the plugin decides, in plain Python: preempt's policy applied to vLLM requests.

Owns: one `RequestView` per vLLM request (what preempt's policies read, taken from the
live vLLM request plus the plugin's own facts: arrival on the plugin's clock, SLA level,
slice used, PREEMPTION_FAILED), and the rules around the policy that preempt's
`Scheduler` applies: time-slice eligibility, the rate cap, the failure fallback and the
admission backoff. The arithmetic is preempt's own (`preempt.engine.policies`,
`preempt.engine.priority.time_slice_s`, `preempt.core.limits`), never a copy. Never imports vLLM and
never mutates a vLLM request: the acting side (`scheduler.py`) does what is decided here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from preempt.core.limits import AdmissionBackoff, RateWindow
from preempt.engine.policies import PriorityScorePolicy, get_policy
from preempt.engine.priority import priority_score, time_slice_s
from preempt.integrations.vllm.metrics import PluginMetrics
from preempt.integrations.vllm.settings import PluginSettings


class RequestView:
    """A vLLM `Request` as preempt's policies see a `preempt.core.request.Request`.

    vLLM's `priority` (smaller is more important) becomes `sla_level = -priority`, read
    once at arrival; progress (computed tokens, outputs) is read live from the request.
    """

    __slots__ = (
        "request",
        "request_id",
        "arrival_s",
        "sla_level",
        "slice_used_s",
        "preemption_failed",
        "preempted_at_s",
        "expected_output_left",
    )

    def __init__(self, request: Any, arrival_s: float) -> None:
        self.request = request
        self.request_id = request.request_id
        self.arrival_s = arrival_s
        self.sla_level = -int(request.priority)
        self.slice_used_s = 0.0
        self.preemption_failed = False
        self.preempted_at_s: float | None = None
        # The plugin's score reads the client's max_tokens (preemption.remaining's default).
        self.expected_output_left: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.request.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def is_fresh(self) -> bool:
        """Never admitted yet (preempt's WAITING, as opposed to PREEMPTED)."""
        return self.request.status.name == "WAITING" and self.request.num_preemptions == 0


class PreemptionDecider:
    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings
        self.preemption = settings.preemption
        self.policy = get_policy(settings.policy, settings.preemption)
        fallback = self.preemption.failure_fallback
        self.uses_failure_fallback = self.policy.uses_failure_fallback if fallback is None else fallback
        self.rate_window = RateWindow()
        self.backoff = AdmissionBackoff(self.preemption.backoff)
        self.metrics = PluginMetrics()

    # ------------------------------------------------------------- decisions
    def admission_key(self, view: RequestView) -> tuple:
        return self.policy.admission_key(view)

    def held_by_backoff(self, view: RequestView, now: float) -> bool:
        """After a preemption failure, requests that never ran wait for the backoff."""
        return self.backoff.holds(now) and view.is_fresh

    def priority_victim(
        self, challenger: RequestView, running: Sequence[RequestView], now: float
    ) -> RequestView | None:
        """The running request `challenger` displaces now, or None. The caller has found
        that the challenger (head of the queue) cannot be admitted. As preempt's
        `Scheduler._priority_preemption`: never beyond the rate cap, only requests that
        used their time slice and are not PREEMPTION_FAILED, and a victim already
        preempted `max_consecutive_preemptions` times takes the fallback instead (the
        policy is then asked again without it)."""
        if self.held_by_backoff(challenger, now):
            return None
        if not self.rate_window.allows(now, self.preemption.max_preemption_per_min):
            self.metrics.rate_limited += 1
            return None
        for _ in range(len(running)):
            candidates = [
                r
                for r in running
                if not r.preemption_failed
                and (not self.policy.uses_time_slices or r.slice_used_s >= time_slice_s(r, self.preemption))
            ]
            victim = self.policy.priority_victim(challenger, candidates, now)
            if victim is None:
                return None
            if (
                self.uses_failure_fallback
                and victim.num_preemptions >= self.preemption.max_consecutive_preemptions
            ):
                self._fail(victim, now, "consecutive_limit")
                continue
            return victim
        return None

    def memory_victim_order(self, running: Sequence[RequestView], now: float) -> list[RequestView]:
        """Every running request, in the order the policy would pick them as victims when
        KV blocks run out (preempt's `select_victim`, applied again and again to what is
        left; PREEMPTION_FAILED requests only as a last resort)."""
        protected = [r for r in running if r.preemption_failed]
        order = self._select_order([r for r in running if not r.preemption_failed], now)
        return order + self._select_order(protected, now)

    def _select_order(self, running: Sequence[RequestView], now: float) -> list[RequestView]:
        if type(self.policy) is PriorityScorePolicy:
            # select_victim is min over reversed(running) by score: the lowest score,
            # ties to the latest in running order. One sort gives the whole sequence
            # (tests check it against repeated select_victim).
            weights = self.preemption.priority_weights
            indexed = list(enumerate(running))
            indexed.sort(key=lambda item: (priority_score(item[1], now, weights), -item[0]))
            return [view for _, view in indexed]
        left = list(running)
        order = []
        while left:
            victim = self.policy.select_victim(left, now)
            left.remove(victim)
            order.append(victim)
        return order

    # ------------------------------------------------------------- bookkeeping
    def on_admitted(self, view: RequestView, now: float) -> None:
        view.slice_used_s = 0.0
        if view.preempted_at_s is not None:
            self.metrics.stall_s += now - view.preempted_at_s
            view.preempted_at_s = None

    def on_preempted(self, view: RequestView, reason: str, now: float, num_tokens_dropped: int) -> None:
        """After vLLM preempted `view` (its counter already incremented)."""
        if self.preemption.fills_rate_cap(forced=reason != "priority"):
            self.rate_window.record(now)
        view.slice_used_s = 0.0
        view.preempted_at_s = now
        self.metrics.on_preemption(reason, num_tokens_dropped)
        if (
            reason != "priority"
            and self.uses_failure_fallback
            and view.num_preemptions >= self.preemption.max_consecutive_preemptions
        ):
            # It has paid enough: from now on only a victim of last resort.
            self._fail(view, now, "consecutive_limit")

    def on_step(self, ran: Sequence[RequestView], step_s: float) -> None:
        """Charge the step's duration to every request that ran in it (time slices)."""
        for view in ran:
            view.slice_used_s += step_s

    def _fail(self, view: RequestView, now: float, failure: str) -> None:
        self.metrics.on_failure(failure)
        if not view.preemption_failed:
            view.preemption_failed = True
            self.metrics.num_preemption_failed += 1
        self.backoff.on_failure(now)
