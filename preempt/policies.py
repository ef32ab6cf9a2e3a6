"""Scheduling policies: admission order and victim choice, chosen by name.

Owns: the small interface the scheduler consults when it must order the waiting queue or
pick a request to preempt, and the registry of named policies. Policies only read request
fields a real server knows (arrival, SLA level, max_tokens, progress); they never look at
`target_output_tokens` (the future) and never mutate a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from preempt.request import Request


class SchedulingPolicy(ABC):
    """Rules every policy keeps:

    - `admission_key` is a total order on waiting requests; the scheduler admits the
      smallest key first and never skips the head (no reordering behind its back).
    - `select_victim` returns one element of `running` (which is in admission order,
      oldest first) and may return the request that is asking for blocks itself.
    """

    name: str

    @abstractmethod
    def admission_key(self, request: Request) -> tuple:
        """Sort key for the waiting queue; smaller is admitted first."""

    @abstractmethod
    def select_victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt when KV blocks run out."""


class VllmFcfsPolicy(SchedulingPolicy):
    """vLLM V1 FCFS: admit by arrival; the victim is the last admitted request."""

    name = "vllm_fcfs"

    def admission_key(self, request: Request) -> tuple:
        # A recompute victim arrived before every request still waiting under FCFS, so
        # sorting by arrival puts it back at the head, as vLLM's `appendleft` does.
        return (request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class VllmPriorityPolicy(SchedulingPolicy):
    """vLLM V1 priority scheduling: admit by (priority, arrival); the victim is the worst
    by (priority, arrival). vLLM's smaller `priority` value is more important; our
    `sla_level` is the opposite, hence the negation."""

    name = "vllm_priority"

    def admission_key(self, request: Request) -> tuple:
        return (-request.sla_level, request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.admission_key)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    VllmFcfsPolicy.name: VllmFcfsPolicy,
    VllmPriorityPolicy.name: VllmPriorityPolicy,
}


def get_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduler.policy '{name}'; choose one of {sorted(POLICIES)}") from None
