"""Scheduling policies: admission order, victim choice and priority preemption, by name.

Owns: the small interface the scheduler consults when it must order the waiting queue,
pick a request to preempt when KV blocks run out, or decide whether a waiting request
may take a running one's place; and the built-in policies (their names:
preempt.core.registry.SCHEDULING_POLICIES). Policies read only
what a real server knows (arrival, SLA level, max_tokens, progress); they never look at
`target_output_tokens` and never mutate a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from preempt.core.config import PreemptionConfig
from preempt.core.registry import SCHEDULING_POLICIES
from preempt.core.request import Request
from preempt.engine.priority import beats, priority_score


class SchedulingPolicy(ABC):
    """Rules every policy keeps:

    - `admission_key` is a total order on waiting requests that does not change while
      they wait; the scheduler admits the smallest key first and never skips the head.
    - `select_victim` returns one element of `running` (admission order, oldest first);
      it may return the request that is asking for blocks itself.
    - `priority_victim` returns a running request the challenger may displace, or None.
      The scheduler has already filtered `candidates` (slice used if `uses_time_slices`,
      not PREEMPTION_FAILED); the policy only compares importance.
    - `uses_failure_fallback` is the default of `preemption.failure_fallback`: whether the
      scheduler applies the design's PREEMPTION_FAILED fallback and backoff. A
      baseline named after a system keeps it off unless that system has one.
    """

    loop: str = "vllm"  # whose scheduling loop runs it: "vllm" (Scheduler) or "sglang"
    uses_time_slices: bool = False
    uses_failure_fallback: bool = False

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config

    @abstractmethod
    def admission_key(self, request: Request) -> tuple:
        """Sort key for the waiting queue; smaller is admitted first."""

    @abstractmethod
    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        """The request to preempt when KV blocks run out."""

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        """A running request `challenger` should displace now; None: no preemption."""
        return None


class VllmFcfsPolicy(SchedulingPolicy):
    """vLLM V1 FCFS (vllm/v1/core/sched/scheduler.py, 0.32.0): admit by arrival; the victim
    is the last admitted request (`self.running.pop()`)."""

    def admission_key(self, request: Request) -> tuple:
        # A victim arrived before every request still waiting under FCFS, so sorting by
        # arrival puts it back at the head, as vLLM's `appendleft` does.
        return (request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return running[-1]


class VllmPriorityPolicy(SchedulingPolicy):
    """vLLM V1 priority scheduling (0.32.0): admit by (priority, arrival, request id), as
    `Request.__lt__` orders its heap; the victim is `max(running, key=(priority,
    arrival_time))`, so among equals the earliest in running order. vLLM's smaller
    `priority` value is more important; our `sla_level` is the opposite, hence the
    negation. Preempts only for memory."""

    def admission_key(self, request: Request) -> tuple:
        return (-request.sla_level, request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        # No request id in the key: vLLM breaks ties by running order (max keeps the first).
        return max(running, key=lambda r: (-r.sla_level, r.arrival_s))


class SglangFcfsPolicy(SchedulingPolicy):
    """SGLang 0.5.23, `--schedule-policy fcfs` without priority scheduling: its own loop
    (`preempt.engine.sglang_scheduler.SglangScheduler`: prefill batches first, decode otherwise,
    new-token-ratio admission, retraction). The waiting queue keeps append order
    (SchedulePolicy.calc_priority does not sort fcfs), retracted requests go to its tail;
    the retraction victim is the request with the fewest output tokens, ties to the
    longest prompt, then to the last in the batch (ScheduleBatch._get_decode_retraction_order
    sorts by (len(output_ids), -len(origin_input_ids)) descending and pops the end)."""

    loop = "sglang"
    priority_scheduling = False

    def admission_key(self, request: Request) -> tuple:
        # Empty: the scheduler's insertion counter alone orders the heap, i.e. append order.
        return (-request.sla_level,) if self.priority_scheduling else ()

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return min(reversed(running), key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens))


class SglangPriorityPolicy(SglangFcfsPolicy):
    """SGLang 0.5.23 with `--enable-priority-scheduling` (fcfs): the queue sorted by
    (priority, entry time) with a larger value more important (our `sla_level`), and
    priority preemption when the running batch is full (`PrefillAdder.preempt_to_schedule`,
    threshold `scheduler.sglang.priority_preemption_threshold`)."""

    priority_scheduling = True


class PriorityScorePolicy(SchedulingPolicy):
    """The design (docs/design.md §1): score = age, SLA and remaining work (preempt.engine.priority); the
    victim is the lowest-scored running request that has used its time slice, and it is
    displaced only when the challenger beats it by the threshold margin."""

    uses_time_slices = True
    uses_failure_fallback = True

    def admission_key(self, request: Request) -> tuple:
        # Every waiting request ages at the same rate, so ordering by the score at time 0
        # (arrival folded into the age term) is the score order at any time, and the
        # heap stays valid while requests wait.
        return (
            -priority_score(request, 0.0, self.config.priority_weights),
            request.arrival_s,
            request.request_id,
        )

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        weights = self.config.priority_weights
        return min(reversed(running), key=lambda r: priority_score(r, now, weights))

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        if not candidates:
            return None
        weights = self.config.priority_weights
        victim = min(reversed(candidates), key=lambda r: priority_score(r, now, weights))
        if beats(
            priority_score(challenger, now, weights),
            priority_score(victim, now, weights),
            self.config.threshold,
            self.config.score_floor,
        ):
            return victim
        if self.config.slice_mode == "quantum" and challenger.sla_level >= victim.sla_level:
            # Time sharing: its slice is used (the scheduler only offers such candidates),
            # so it yields its seat; a lower SLA level never takes a higher one's.
            return victim
        return None


class FastServeMlfqPolicy(SchedulingPolicy):
    """FastServe's skip-join MLFQ (Wu et al., "Fast Distributed Inference Serving for Large
    Language Models", arXiv 2305.05920, §4.1), at iteration granularity: the request in
    the highest queue runs first (FIFO within a queue); a new request skips the queues
    whose quantum its first iteration (prefill) would overrun; a request moves one queue
    down each time its executed time uses up its queue's quantum; and a waiting request of
    a higher queue preempts the running request of the lowest one (at most one per step,
    the scheduler's rule). Memory victims: the lowest queue, latest arrival. FastServe
    swaps KV out proactively; here what happens to the KV is `preemption.mode`'s."""

    def level(self, request: Request) -> int:
        """The request's queue: 0 is the highest. A pure function of what the request has
        done (prompt length, executed time), so a waiting request's level cannot move."""
        mlfq = self.config.mlfq
        quantum_ms = [mlfq.base_quantum_ms * mlfq.quantum_ratio**i for i in range(mlfq.num_levels)]
        first_iteration_ms = request.num_prompt_tokens / mlfq.join_tokens_per_ms
        join = next((i for i, q in enumerate(quantum_ms) if q >= first_iteration_ms), mlfq.num_levels - 1)
        # Quanta used from the join level on: level j is left after sum(quantum[join..j]).
        level, spent_ms = join, request.executed_s * 1000.0
        while level < mlfq.num_levels - 1 and spent_ms >= quantum_ms[level]:
            spent_ms -= quantum_ms[level]
            level += 1
        return level

    def admission_key(self, request: Request) -> tuple:
        return (self.level(request), request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(running, key=lambda r: (self.level(r), r.arrival_s))

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        if not candidates:
            return None
        victim = self.select_victim(candidates, now)
        return victim if self.level(challenger) < self.level(victim) else None


def get_policy(name: str, config: PreemptionConfig | None = None) -> SchedulingPolicy:
    """The policy `name` (preempt.core.registry.SCHEDULING_POLICIES, or an import path)."""
    policy_cls = SCHEDULING_POLICIES.resolve(name)
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, SchedulingPolicy)):
        raise ValueError(
            f"scheduler.policy '{name}' is not a preempt.engine.policies.SchedulingPolicy subclass"
        )
    return policy_cls(config or PreemptionConfig())
