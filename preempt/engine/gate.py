"""The gate around priority preemption: the one home of the rules that decide whether a
policy's priority victim may be taken now.

Owns: the rate cap (`RateWindow`, `max_preemption_per_min`, `rate_cap_counts`), the
admission backoff after a preemption failure (`AdmissionBackoff`, `backoff`), time-slice
eligibility, and the consecutive-preemption limit with its PREEMPTION_FAILED fallback.
Plain Python over request-like objects with the fields preempt's `Request` and the vLLM
plugin's `RequestView` both have (`slice_used_s`, `preemption_failed`, `num_preemptions`,
`num_tokens`, and what the policy reads); it never preempts anyone itself. Used by
`preempt.engine.scheduler.Scheduler` and by the plugin's `PreemptionDecider`
(`preempt.integrations.vllm.decider`), so both apply the same rules by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from preempt.core.config import PreemptionConfig
from preempt.core.limits import RATE_WINDOW_S, AdmissionBackoff, RateWindow
from preempt.engine.policies import SchedulingPolicy
from preempt.engine.priority import time_slice_s


class PreemptionGate:
    def __init__(self, preemption: PreemptionConfig, policy: SchedulingPolicy) -> None:
        self.preemption = preemption
        self.policy = policy
        # The design's fallback (PREEMPTION_FAILED, protected victims, backoff) runs only
        # where the policy has it by default or the config asks for it: vLLM has none.
        fallback = preemption.failure_fallback
        self.uses_failure_fallback = policy.uses_failure_fallback if fallback is None else fallback
        self.rate_window = RateWindow(RATE_WINDOW_S)  # preemptions in the last minute
        self.backoff = AdmissionBackoff(preemption.backoff)
        self.num_rate_limited = 0  # priority preemptions the cap refused (steps asked)

    # ------------------------------------------------------------- checks
    def holds(self, now: float, fresh: bool) -> bool:
        """Whether the backoff keeps a waiting request from admission (and from displacing
        anyone) at `now`: only requests that never ran (`fresh`) wait; preempted ones may
        resume (they already hold host or device memory)."""
        return fresh and self.backoff.holds(now)

    def rate_allows(self, now: float) -> bool:
        """Whether one more priority preemption fits under `max_preemption_per_min`."""
        return self.rate_window.allows(now, self.preemption.max_preemption_per_min)

    def eligible(self, running: Sequence[Any]) -> list[Any]:
        """Running requests a priority preemption may take: not PREEMPTION_FAILED, and (for
        a policy with time slices) done with their slice."""
        slices = self.policy.uses_time_slices
        return [
            r
            for r in running
            if not r.preemption_failed and (not slices or r.slice_used_s >= time_slice_s(r, self.preemption))
        ]

    def over_consecutive_limit(self, request: Any) -> bool:
        """With the fallback: `request` was preempted `max_consecutive_preemptions` times
        already, so it takes the fallback (PREEMPTION_FAILED) instead of another one."""
        return (
            self.uses_failure_fallback
            and request.num_preemptions >= self.preemption.max_consecutive_preemptions
        )

    # ------------------------------------------------------------- the trigger
    def priority_victim(
        self,
        challenger: Any,
        running: Sequence[Any],
        now: float,
        fresh: bool,
        take: Callable[[Any], bool],
    ) -> Any | None:
        """The running request `challenger` (the head of the queue, which the caller found
        cannot be admitted; `fresh`: it never ran) displaces now, or None. Never while the
        backoff holds the challenger or beyond the rate cap; the policy names a victim
        among the eligible requests and `take(victim)` preempts it, or returns False when
        the victim took the fallback instead (it is then PREEMPTION_FAILED, so no longer
        eligible, and the policy is asked again)."""
        if not self.asks_policy(now, fresh):
            return None
        for _ in range(len(running)):
            victim = self.policy.priority_victim(challenger, self.eligible(running), now)
            if victim is None:
                return None
            if take(victim):
                return victim
        return None

    def asks_policy(self, now: float, fresh: bool) -> bool:
        """Whether the trigger asks the policy for a victim at `now` (`priority_victim`'s
        first half, which decode runs also apply to each of their steps): never for a
        policy that displaces nobody (nothing for the cap to refuse), nor while the
        backoff holds the challenger; a refusal of the rate cap is counted."""
        if not self.policy.preempts_for_priority or self.holds(now, fresh):
            return False
        if not self.rate_allows(now):
            self.num_rate_limited += 1
            return False
        return True

    # ------------------------------------------------------------- bookkeeping
    def on_preempted(self, now: float, forced: bool) -> None:
        """A preemption happened (`forced`: by running out of KV blocks): into the rate
        cap's window if `rate_cap_counts` says it counts."""
        if self.preemption.fills_rate_cap(forced):
            self.rate_window.record(now)

    def on_failure(self, request: Any, now: float, forced: bool) -> bool:
        """A preemption of `request` failed or hit the consecutive limit (`forced`: one made
        because KV blocks ran out). With the fallback: mark it PREEMPTION_FAILED (never a
        priority victim again, a memory victim only as a last resort) and, if
        `backoff.counts` says this failure counts, back new admissions off. Returns True
        when `request` is newly marked; without the fallback nothing changes (False)."""
        if not self.uses_failure_fallback:
            return False
        newly = not request.preemption_failed
        request.preemption_failed = True
        if self.preemption.backoff.counts == "all" or not forced:
            self.backoff.on_failure(now)
        return newly
