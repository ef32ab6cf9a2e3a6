"""What the plugin decides, in plain Python: preempt's policy applied to vLLM requests.

Owns: one `RequestView` per vLLM request (what preempt's policies read, taken from the
live vLLM request plus the plugin's own facts: arrival on the plugin's clock, SLA level,
slice used, PREEMPTION_FAILED), and the plugin's metrics of what was decided. The rules
around the policy (time-slice eligibility, the rate cap, the failure fallback and the
admission backoff) are preempt's `Scheduler`'s own object, `preempt.engine.gate.PreemptionGate`,
and the arithmetic is `preempt.engine.policies` / `preempt.engine.priority`: never a copy.
Never imports vLLM and never mutates a vLLM request: the acting side (`scheduler.py`)
does what is decided here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from preempt.core.limits import AdmissionBackoff
from preempt.engine.gate import PreemptionGate
from preempt.engine.policies import PriorityScorePolicy, get_policy
from preempt.engine.priority import priority_score
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
        # None: the score reads the client's max_tokens (preemption.remaining's default);
        # `learned` sets it at arrival and after each step (PreemptionDecider.estimate).
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
        self.gate = PreemptionGate(self.preemption, self.policy)
        self.metrics = PluginMetrics()
        self.remaining = None  # preemption.remaining: learned, with its length model
        if self.preemption.remaining == "learned":
            from preempt.engine.lengths import LengthModel
            from preempt.engine.remaining import LearnedRemaining

            self.remaining = LearnedRemaining(LengthModel.load(self.preemption.length_model))

    def estimate(self, views: Sequence[RequestView]) -> None:
        """Re-estimate the output `views` still have to make (`learned` only), as preempt's
        scheduler does at enqueue and after each token: read by the score and by the
        connector's early-copy projection."""
        if self.remaining is not None:
            for view in views:
                self.remaining.update(view)

    @property
    def backoff(self) -> AdmissionBackoff:
        return self.gate.backoff

    # ------------------------------------------------------------- decisions
    def admission_key(self, view: RequestView) -> tuple:
        return self.policy.admission_key(view)

    def held_by_backoff(self, view: RequestView, now: float) -> bool:
        """After a preemption failure, requests that never ran wait for the backoff."""
        return self.gate.holds(now, fresh=view.is_fresh)

    def priority_victim(
        self, challenger: RequestView, running: Sequence[RequestView], now: float
    ) -> RequestView | None:
        """The running request `challenger` displaces now, or None. The caller has found
        that the challenger (head of the queue) cannot be admitted. As preempt's
        `Scheduler._priority_preemption`: never beyond the rate cap, only requests that
        used their time slice and are not PREEMPTION_FAILED, and a victim already
        preempted `max_consecutive_preemptions` times takes the fallback instead (the
        policy is then asked again without it). The rules are the gate's
        (`PreemptionGate.priority_victim`), as in preempt's engine."""

        def take(victim: RequestView) -> bool:
            if self.gate.over_consecutive_limit(victim):
                self._fail(victim, now, "consecutive_limit", forced=False)
                return False
            return True  # the scheduler preempts it

        refused = self.gate.num_rate_limited
        victim = self.gate.priority_victim(challenger, running, now, challenger.is_fresh, take)
        self.metrics.rate_limited += self.gate.num_rate_limited - refused
        return victim

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
        forced = reason != "priority"
        self.gate.on_preempted(now, forced)
        view.slice_used_s = 0.0
        view.preempted_at_s = now
        self.metrics.on_preemption(reason, num_tokens_dropped)
        if forced and self.gate.over_consecutive_limit(view):
            # It has paid enough: from now on only a victim of last resort.
            self._fail(view, now, "consecutive_limit", forced=True)

    def on_step(self, ran: Sequence[RequestView], step_s: float) -> None:
        """Charge the step's duration to every request that ran in it (time slices)."""
        for view in ran:
            view.slice_used_s += step_s

    def _fail(self, view: RequestView, now: float, failure: str, *, forced: bool) -> None:
        self.metrics.on_failure(failure)
        if self.gate.on_failure(view, now, forced):
            self.metrics.num_preemption_failed += 1
