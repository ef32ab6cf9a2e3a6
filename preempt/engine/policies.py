"""Scheduling policies: admission order, victim choice and priority preemption, by name.

Owns: the small interface the scheduler consults when it must order the waiting queue,
pick a request to preempt when KV blocks run out, or decide whether a waiting request
may take a running one's place; and the built-in policies (their names:
preempt.core.registry.SCHEDULING_POLICIES). Policies read only
what a real server knows (arrival, SLA level, max_tokens, progress); they never look at
`target_output_tokens` and never mutate a request.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

from preempt.core.config import PreemptionConfig
from preempt.core.registry import SCHEDULING_POLICIES
from preempt.core.request import Request, RequestState
from preempt.engine.priority import beats, output_left, priority_score, remaining_ktokens


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

    def on_enqueue(self, request: Request) -> None:
        """`request` enters the waiting queue: a new arrival, or a preempted one back (state
        PREEMPTED). Called just before its `admission_key`; a policy whose order depends on
        where a request joins its queue records that here."""
        return None

    # Whether `on_enqueue` reads state that `on_step` changes (SRPT's clock): an arrival
    # inside a decode run then joins only once the steps before it are applied.
    enqueue_reads_steps = True

    def arrival_key(self, request: Request) -> tuple:
        """A key that orders a new arrival against the queued requests as the key it gets
        on joining (`on_enqueue`, then `admission_key`) will, read before it joins (a
        decode run asks whether an arrival would lead the queue)."""
        return self.admission_key(request)

    def on_step(self, ran: Sequence[Request], step_s: float, now: float) -> Collection[Request]:
        """The step that ran `ran` (their time already charged) ended at `now`. Returns the
        waiting requests whose admission keys it changed (the scheduler re-sorts them)."""
        return ()

    @property
    def preempts_for_priority(self) -> bool:
        """Whether it ever displaces a running request for a waiting one (it overrides
        `priority_victim`); one that does not leaves the rate cap nothing to refuse."""
        return type(self).priority_victim is not SchedulingPolicy.priority_victim

    # Decode runs (preempt.engine.decode_runs): consecutive steps of one batch that only
    # decodes, applied at once. A policy with per-step state takes part by giving the
    # batch form of its `on_step`; the base one keeps none, so any run suits it.
    @property
    def takes_decode_runs(self) -> bool:
        """Whether its steps may be applied many at a time: it keeps no per-step state, or
        it gives the batch form of `on_step` (both `quiet_steps` and `on_decode_run`)."""
        cls = type(self)
        return cls.on_step is SchedulingPolicy.on_step or (
            cls.quiet_steps is not SchedulingPolicy.quiet_steps
            and cls.on_decode_run is not SchedulingPolicy.on_decode_run
        )

    def quiet_steps(self, ran: Sequence[Request], ends_s: Sequence[float]) -> int:
        """How many of the next steps of the batch `ran` (ending at `ends_s`, nobody leaving
        it) pass before its state may move a waiting request: none of them but the last
        does (one `on_decode_run` call may stand for any of them). 0: none may be run."""
        return len(ends_s)

    def on_decode_run(
        self, ran: Sequence[Request], step_s: Sequence[float], ends_s: Sequence[float]
    ) -> Collection[Request]:
        """`on_step` for each of these steps of `ran` at once (`quiet_steps` of them at
        most; those that finish, `finish_s` set, finished in the last). Returns the
        waiting requests whose keys the last step changed."""
        return ()


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


class VllmLcfPolicy(VllmFcfsPolicy):
    """vLLM 0.32 V1 FCFS with the victim rule of RFC vllm-project/vllm#54644 ("least
    computed first"; `--preemption-victim lcf` in the open PR #53723, not in any
    release): when KV blocks run out, the victim is `min(running,
    key=num_computed_tokens)`, the request whose KV cost least to compute, so the least
    work is thrown away; ties go to the last admitted (the PR walks the running queue in
    reverse). Admission stays vLLM's FCFS: its waiting deque, where an arrival is appended
    and a victim put back at the head (`prepend_request`). Under FCFS's own victim (the
    last admitted) sorting by arrival is that order; an LCF victim may have arrived after
    requests still waiting and goes ahead of them all the same, hence the places kept here.
    The RFC measures recomputation at 10-23% of token compute online, about half of it due
    to the victim choice. Step-identical to vLLM's own scheduler with the rule patched into
    its source (`preempt parity vllm --policy lcf`, docs/parity.md)."""

    def __init__(self, config: PreemptionConfig) -> None:
        super().__init__(config)
        self._place: dict[Request, int] = {}
        self._back = itertools.count(0)
        self._front = itertools.count(-1, -1)

    def on_enqueue(self, request: Request) -> None:
        counter = self._front if request.state is RequestState.PREEMPTED else self._back
        self._place[request] = next(counter)

    enqueue_reads_steps = False  # places of its own, never the clock

    def arrival_key(self, request: Request) -> tuple:
        return (math.inf,)  # appended: behind every queued request

    def admission_key(self, request: Request) -> tuple:
        return (self._place[request],)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return min(reversed(running), key=lambda r: r.num_computed_tokens)


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


class UniBoostPolicy(SglangFcfsPolicy):
    """UniBoost's waiting order (ICML 2026; its public code, the SGLang fork yl3469/sglang
    at 9979a9a, `--schedule-policy uniboost`, UB: python/sglang/srt/managers/
    schedule_policy.py) over SGLang 0.5.23's loop, which it otherwise leaves as is: the
    waiting queue is sorted by Phi = entry time - boost(w), smaller first (UB:693-703),
    where boost(w) = -ln(1 - e^(-gamma w)) / gamma (UB:660-680; `1e9` for w <= 0), w =
    64 µs x the request's uncached tokens (UB:92-94, 398), gamma = 10/s (UB:91): gamma-Boost
    (Yu & Scully, arXiv 2404.08826), so a short prompt jumps ahead by up to ~0.7 s and a
    long one by almost nothing. Rule by rule (UB:682-691):

    - the entry time is SGLang's `wait_queue_entry_time`, stamped whenever a request joins
      the queue, a retracted one included (SCH:3480-3495): here the engine's clock then;
    - the tokens are the prompt and the output so far (what a retracted request must
      compute again), none cached: this engine has no prefix cache;
    - ties keep queue order (Python's sort is stable: here the queue's first in, first
      out); request priority is not read;
    - admission, retraction (fewest outputs first) and the memory budget are SGLang's.

    Not here: the adaptive gamma (`SGLANG_UNIBOOST_GAMMA_ADA`, off by default: a thread
    refits gamma every 5 s from the p99/p95 of measured latencies, UB:116-306), and what
    only the paper describes (priorities over running requests, its memory guard), which
    the public code does not implement."""

    GAMMA_PER_S = 10.0  # SGLANG_UNIBOOST_GAMMA
    WORK_S_PER_TOKEN = 64e-6  # SGLANG_UNIBOOST_ALPHA_US_PER_TOKEN, in seconds

    def __init__(self, config: PreemptionConfig) -> None:
        super().__init__(config)
        self._entry_s: dict[Request, float] = {}
        self._now = 0.0  # the end of the last step: the clock when a request joins

    @classmethod
    def boost_s(cls, num_tokens: int) -> float:
        """How far ahead of its entry time a request of `num_tokens` uncached tokens goes."""
        work_s = cls.WORK_S_PER_TOKEN * max(num_tokens, 0)
        if work_s <= 0:
            return 1e9
        gamma = cls.GAMMA_PER_S
        return -math.log(-math.expm1(-gamma * work_s)) / gamma

    def on_enqueue(self, request: Request) -> None:
        # an arrival joins at the step boundary after it arrived; a retracted request at
        # the step that retracted it (its schedule time, the last step's end)
        self._entry_s[request] = max(request.arrival_s, self._now)

    def on_step(self, ran: Sequence[Request], step_s: float, now: float) -> Collection[Request]:
        self._now = now
        for request in ran:
            if request.finish_s is not None:
                self._entry_s.pop(request, None)
        return ()

    def admission_key(self, request: Request) -> tuple:
        entry_s = self._entry_s.get(request, request.arrival_s)
        return (entry_s - self.boost_s(request.num_tokens),)


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


class ClassStrictScorePolicy(PriorityScorePolicy):
    """The design's score inside a class, the SLA level first (docs/results.md, "the design
    where it can win"): a waiting request of a higher level is admitted before any of a
    lower one, the victim is the lowest-level running request (the lowest score among
    them), and a challenger of a higher level displaces one of a lower level whose slice is
    used. Within a level the score and its margin decide, as in `priority_score`. So
    waiting and remaining work order requests within a class, never across one: strict
    priority's order between classes, the score's within them."""

    def admission_key(self, request: Request) -> tuple:
        return (-request.sla_level, *super().admission_key(request))

    def _rank(self, request: Request, now: float) -> tuple[int, float]:
        return (request.sla_level, priority_score(request, now, self.config.priority_weights))

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return min(reversed(running), key=lambda r: self._rank(r, now))

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        if not candidates:
            return None
        victim = min(reversed(candidates), key=lambda r: self._rank(r, now))
        if victim.sla_level != challenger.sla_level:
            return victim if challenger.sla_level > victim.sla_level else None
        return super().priority_victim(challenger, [victim], now)


class FastServeMlfqPolicy(SchedulingPolicy):
    """FastServe's skip-join MLFQ (Wu et al., arXiv 2305.05920 §4.1), rule by rule as its
    public artifact schedules (LLMServe/FastServe@187a274, fastserve/scheduler.py `MLFQ`,
    FS: below; docs/fastserve.md has the table and what differs):

    - skip-join: a new request joins the first queue k with quantum 10 ms * 2^k >= its
      first iteration's time, the prefill of its prompt alone (FS:471-481, 426-448);
    - queues are FIFO; a new request goes to the back of its queue (FS:478), a request
      taken out of the batch to the front (FS:510, 552, 559);
    - demotion: after each iteration a request whose time at its level exceeds the level's
      quantum moves one queue down and its time restarts (FS:494-512);
    - starvation: every 1000th iteration a waiting request whose last iteration ended at
      least 3 s ago moves to the front of the top queue, its time kept (FS:561-564,
      595-617);
    - the batch is the queues' heads in order (FS:531-566): a waiting request of a higher
      queue displaces the running request of the lowest one, latest in its queue;
      memory victims likewise (FS:656-690).

    State lives here, keyed by request (a policy never mutates a request): each request's
    level, time at that level, place in its queue and last iteration's end."""

    def __init__(self, config: PreemptionConfig) -> None:
        super().__init__(config)
        self._level: dict[Request, int] = {}
        self._level_s: dict[Request, float] = {}
        self._place: dict[Request, int] = {}
        self._last_step_s: dict[Request, float] = {}
        self._waiting: set[Request] = set()
        self._back = itertools.count(0)
        self._front = itertools.count(-1, -1)
        self._steps = 0
        self._quanta: dict[int, float] = {}

    def quantum_s(self, level: int) -> float:
        quantum_s = self._quanta.get(level)
        if quantum_s is None:  # read for every running request after every step
            mlfq = self.config.mlfq
            quantum_s = self._quanta[level] = mlfq.base_quantum_ms * mlfq.quantum_ratio**level / 1000.0
        return quantum_s

    def _bottom(self, level: int) -> int:
        num_levels = self.config.mlfq.num_levels
        return level if num_levels is None else min(level, num_levels - 1)

    def join_level(self, request: Request) -> int:
        """Skip-join: the first queue whose quantum covers the prompt's prefill alone."""
        first_iteration_s = request.num_prompt_tokens / self.config.mlfq.join_tokens_per_ms / 1000.0
        num_levels, level = self.config.mlfq.num_levels, 0
        while self.quantum_s(level) < first_iteration_s and (num_levels is None or level < num_levels - 1):
            level += 1
        return level

    def level(self, request: Request) -> int:
        """The request's queue (0 is the highest)."""
        level = self._level.get(request)
        return self.join_level(request) if level is None else level

    def _place_of(self, request: Request) -> int:
        return self._place.get(request, request.request_id)

    def on_enqueue(self, request: Request) -> None:
        if request not in self._level:  # a new arrival: skip-join, back of its queue
            self._level[request] = self.join_level(request)
            self._level_s[request] = 0.0
            self._place[request] = next(self._back)
        else:  # out of the batch: front of its queue
            self._place[request] = next(self._front)
        self._waiting.add(request)

    enqueue_reads_steps = False  # levels, places and counters of its own, never the clock

    def arrival_key(self, request: Request) -> tuple:
        # the back of its join queue: behind every queued request of that queue
        return (self.join_level(request), math.inf, request.request_id)

    def on_step(self, ran: Sequence[Request], step_s: float, now: float) -> Collection[Request]:
        return self.on_decode_run(ran, (step_s,), (now,))

    def quiet_steps(self, ran: Sequence[Request], ends_s: Sequence[float]) -> int:
        # up to the next starvation check, which may move waiting requests
        every = self.config.mlfq.starvation_every_steps
        return min(len(ends_s), every - self._steps % every)

    def on_decode_run(
        self, ran: Sequence[Request], step_s: Sequence[float], ends_s: Sequence[float]
    ) -> Collection[Request]:
        self._steps += len(step_s)
        now = ends_s[-1]
        levels, level_times, last_step_s = self._level, self._level_s, self._last_step_s
        self._waiting.difference_update(ran)
        for request in ran:
            last_step_s[request] = now
            if request.finish_s is not None:
                for state in (levels, level_times, self._place, last_step_s):
                    state.pop(request, None)
                continue
            # time at its level, step by step (its sums in step order), demoted past a quantum
            level = levels.get(request)
            if level is None:
                level = self.join_level(request)
            quantum_s = self.quantum_s(level)
            level_s = level_times.get(request, 0.0)
            for seconds in step_s:
                level_s += seconds
                if level_s > quantum_s:
                    level = self._bottom(level + 1)
                    levels[request] = level
                    quantum_s = self.quantum_s(level)
                    level_s = 0.0
            level_times[request] = level_s
        if self._steps % self.config.mlfq.starvation_every_steps:
            return ()
        # FS:595-617: collected from the top queue down, each pushed to the front of the
        # top queue in turn (so the last collected ends first).
        starving = sorted(
            (
                r
                for r in self._waiting
                if r.finish_s is None
                and now - self._last_step_s.get(r, r.arrival_s) >= self.config.mlfq.starvation_s
            ),
            key=self.admission_key,
        )
        for request in starving:
            self._level[request] = 0
            self._place[request] = next(self._front)
        return starving

    def admission_key(self, request: Request) -> tuple:
        return (self.level(request), self._place_of(request), request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(running, key=self.admission_key)

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        if not candidates:
            return None
        victim = self.select_victim(candidates, now)
        return victim if self.level(challenger) < self.level(victim) else None


class SrptPolicy(SchedulingPolicy):
    """Shortest predicted remaining work first, with a starvation guard and limited
    preemption: the length-aware baseline, fed the same estimate as the score
    (`preemption.remaining`, preempt.engine.remaining). Rule by rule (docs/srpt.md):

    - order: the waiting request with the least expected remaining work (prompt not yet
      computed plus expected output left) is admitted first: SRPT, as Fu et al. (NeurIPS
      2024, "Efficient LLM Scheduling by Learning to Rank") order by predicted length and
      Trail (Shahout et al., ICLR 2025) by predicted remaining length;
    - starvation guard: a request waiting `srpt_starvation_s` since it arrived or last ran
      goes ahead of every non-starving request, oldest first (Fu et al.'s starvation
      prevention, in seconds rather than iterations);
    - preemption: a waiting request displaces the running request with the most expected
      remaining work when its own is smaller, and only while that victim has made less than
      `srpt_preempt_below` of its expected output (Trail's limited preemption: late in a
      request's life, finishing it is cheaper than its KV); memory victims: the most
      remaining work.

    It reads no SLA class: the design's score adds what this leaves out."""

    def __init__(self, config: PreemptionConfig) -> None:
        super().__init__(config)
        self._since: dict[Request, float] = {}  # waiting request -> when it joined the queue
        self._joined: collections.deque[tuple[float, Request]] = collections.deque()  # in join order
        self._starving: set[Request] = set()
        self._now = 0.0

    def on_enqueue(self, request: Request) -> None:
        since = max(request.arrival_s, self._now)  # join times never decrease: a FIFO of them
        self._since[request] = since
        self._joined.append((since, request))
        self._starving.discard(request)

    def on_step(self, ran: Sequence[Request], step_s: float, now: float) -> Collection[Request]:
        self._now = now
        for request in ran:
            self._since.pop(request, None)
            self._starving.discard(request)
        threshold = self.config.srpt_starvation_s
        starving = []
        while self._joined and self._joined[0][0] + threshold <= now:
            since, request = self._joined.popleft()
            if self._since.get(request) == since and request.finish_s is None:
                self._starving.add(request)
                starving.append(request)
        return starving

    def quiet_steps(self, ran: Sequence[Request], ends_s: Sequence[float]) -> int:
        # up to the step that ends when the longest waiter may start to starve
        if not self._joined:
            return len(ends_s)
        due_s = self._joined[0][0] + self.config.srpt_starvation_s
        return min(len(ends_s), bisect.bisect_left(ends_s, due_s) + 1)

    def on_decode_run(
        self, ran: Sequence[Request], step_s: Sequence[float], ends_s: Sequence[float]
    ) -> Collection[Request]:
        # Before the last step nothing is due (`quiet_steps`) and the batch's requests left
        # the queue's books when they first ran: only the last step's `on_step` acts.
        return self.on_step(ran, step_s[-1], ends_s[-1])

    def admission_key(self, request: Request) -> tuple:
        if request in self._starving:
            return (0, self._since.get(request, request.arrival_s), request.request_id)
        return (1, remaining_ktokens(request), request.arrival_s, request.request_id)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(reversed(running), key=remaining_ktokens)

    def priority_victim(
        self, challenger: Request, candidates: Sequence[Request], now: float
    ) -> Request | None:
        below = self.config.srpt_preempt_below
        early = [
            r for r in candidates if r.num_output_tokens < below * (r.num_output_tokens + output_left(r))
        ]
        if not early:
            return None
        victim = self.select_victim(early, now)
        return victim if remaining_ktokens(challenger) < remaining_ktokens(victim) else None


def get_policy(name: str, config: PreemptionConfig | None = None) -> SchedulingPolicy:
    """The policy `name` (preempt.core.registry.SCHEDULING_POLICIES, or an import path)."""
    policy_cls = SCHEDULING_POLICIES.resolve(name)
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, SchedulingPolicy)):
        raise ValueError(
            f"scheduler.policy '{name}' is not a preempt.engine.policies.SchedulingPolicy subclass"
        )
    return policy_cls(config or PreemptionConfig())
