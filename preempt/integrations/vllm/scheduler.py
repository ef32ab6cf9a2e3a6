"""`PreemptScheduler`: vLLM 0.32's V1 `Scheduler` with preempt's policy deciding.

Runs inside vLLM (the peer virtualenv, or any vLLM 0.32 install with `preempt` on the
path): `--scheduler-cls preempt.integrations.vllm.scheduler.PreemptScheduler`. Imports
vLLM; never import it from preempt's own code paths.

Two classes, one policy code (`PreemptDecisions`): `PreemptScheduler` on vLLM's
`Scheduler`, `PreemptAsyncScheduler` on its `AsyncScheduler` (which keeps the output
placeholders a step scheduled while the previous one still runs needs). vLLM keeps its
`async_scheduling` as its config decided whatever class `--scheduler-cls` names, and only
an `AsyncScheduler` keeps up with it; so preempt's general plugin (plugin.py) puts the
async class in the config wherever vLLM chose async scheduling (on GPUs by default; vLLM's
CPU platform turns it off for every scheduler) and the plain one elsewhere.

vLLM's `schedule()` runs unchanged; the plugin decides around it, at three seams:

1. Admission order: both waiting queues are a heap by preempt's `admission_key` (the
   priority score at arrival for `priority_score`); vLLM still admits the head first and
   never skips it. While a preemption failure's backoff holds and the head never ran,
   the queue reads as empty to vLLM's admission loop, which therefore stops, as preempt's
   does.
2. Displacement: before `schedule()`, if the head of the queue cannot be admitted (no
   seat or too few free blocks for its whole sequence), preempt's policy may name one
   running request to displace (time slice used, rate cap, fallback: `decider.py`); it is
   preempted through vLLM's own `_preempt_request` (recompute).
3. Memory victims: vLLM's running pass preempts `max(running, key=(priority,
   arrival_time))` under its PRIORITY policy. The plugin runs that branch and, for the
   length of one `schedule()` call, gives each running request a `priority` equal to its
   rank in preempt's victim order (`select_victim` applied again and again), then
   restores vLLM's values. vLLM's refund of a victim's scheduled tokens and its "a
   request that preempts itself ends the pass" are the same rules as preempt's.

Time slices are charged in `update_from_output` from the plugin's clock (settings.clock).
With preempt's KV connector loaded (`connector.py`), a `SavePlanner` (`saves.py`) tells it
whom to save and whom to copy early.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.request_queue import SchedulingPolicy as VllmPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from preempt.integrations.vllm.clock import make_clock
from preempt.integrations.vllm.connector import PreemptKVConnector
from preempt.integrations.vllm.decider import PreemptionDecider, RequestView
from preempt.integrations.vllm.metrics import PrometheusExport, SnapshotWriter
from preempt.integrations.vllm.saves import SavePlanner
from preempt.integrations.vllm.settings import load_settings
from preempt.integrations.vllm.steplog import StepLogging


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PolicyQueue(RequestQueue):
    """A waiting queue ordered by preempt's admission key (computed when a request
    enters; it does not change while the request waits), FIFO among equal keys."""

    def __init__(self, key: Callable[[Request], tuple], held: Callable[[Request], bool]) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._key = key
        self._held = held
        self._counter = itertools.count()
        self.gated = False  # True only inside schedule(): the backoff may hold the head

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._counter), request))

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[2]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][2]

    def prepend_request(self, request: Request) -> None:
        # No front in a priority order: a victim goes back by its key, as in preempt.
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[2]) not in gone]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        if not self._heap:
            return False
        return not (self.gated and self._held(self._heap[0][2]))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1]))])


class PreemptDecisions:
    """preempt's seams in vLLM's scheduler (module docstring), over whichever of vLLM's
    scheduler classes comes after it in the class's bases."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, **kwargs) -> None:
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size, **kwargs)
        self._open_step_log()  # every step's shape and wall time, with additional_config.step_log
        self.settings = load_settings(vllm_config.additional_config)
        self.decider = PreemptionDecider(self.settings)
        self.clock = make_clock(self.settings.clock, self.settings.step_ms)
        self.views: dict[str, RequestView] = {}
        # The PRIORITY branch of vLLM's running pass: victim by (priority, arrival_time),
        # with the refund of its tokens; the plugin supplies the priorities (seam 3).
        self.policy = VllmPolicy.PRIORITY
        self.waiting = PolicyQueue(self._admission_key, self._held)
        self.kv_holding_waiting = PolicyQueue(self._admission_key, self._held)
        self._num_steps = 0
        self._step_now = 0.0
        self._reason = "other"
        # Both routes to `/metrics` (metrics.py): counters for a multiprocess directory or
        # one process, snapshots for the API server's collector (stat_logger.py).
        self._export = PrometheusExport() if self.log_stats else None
        self._snapshots = SnapshotWriter() if self.log_stats else None
        # preempt's KV connector, when vLLM loaded it (--kv-transfer-config): the plugin
        # decides whom it saves and whom it copies ahead of a predicted preemption.
        self.save_planner: SavePlanner | None = None
        if isinstance(self.connector, PreemptKVConnector):
            self.save_planner = SavePlanner(
                self.decider,
                self.connector.settings,
                self.block_size,
                self._save_state,
                self.connector.metrics,
            )
            self.connector.advisor = self.save_planner

    def _save_state(self) -> tuple[list[RequestView], int, float]:
        running = [self.views[r.request_id] for r in self.running if r.request_id in self.views]
        return running, self.kv_cache_manager.block_pool.get_num_free_blocks(), self._step_now

    # ------------------------------------------------------------- queue seams
    def _admission_key(self, request: Request) -> tuple:
        return self.decider.admission_key(self.views[request.request_id])

    def _held(self, request: Request) -> bool:
        return self.decider.held_by_backoff(self.views[request.request_id], self._step_now)

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.views:
            self.views[request.request_id] = RequestView(request, self.clock.now())
            self.decider.estimate([self.views[request.request_id]])
        super().add_request(request)

    # ------------------------------------------------------------- the step
    def schedule(self, throttle_prefills: bool = False):
        step = self._num_steps
        self._num_steps += 1
        now = self.clock.start_step(step)
        self._step_now = now
        self._priority_preemption(now)
        before = {id(r) for r in self.running}
        saved = [(r, r.priority) for r in self.running]
        order = self.decider.memory_victim_order([self.views[r.request_id] for r in self.running], now)
        for rank, view in enumerate(order):
            view.request.priority = len(order) - rank  # vLLM preempts the max first
        self.waiting.gated = self.kv_holding_waiting.gated = True
        self._reason = "memory"
        try:
            output = super().schedule(throttle_prefills)
        finally:
            for request, priority in saved:
                request.priority = priority
            self.waiting.gated = self.kv_holding_waiting.gated = False
            self._reason = "other"
        for request in self.running:
            if id(request) not in before:
                self.decider.on_admitted(self.views[request.request_id], now)
        return output

    def _challenger(self) -> Request | None:
        """The request vLLM's admission loop tries first: the head of `kv_holding_waiting`
        (drained first), else of `waiting`, past requests still loading their KV (vLLM
        skips them; they hold their blocks and take a seat once loaded)."""
        for queue in (self.kv_holding_waiting, self.waiting):
            if not len(queue):
                continue
            head = queue.peek_request()
            if not self._loading(head):
                return head
            for request in queue:  # the queue in admission order: only while a head loads
                if not self._loading(request):
                    return request
        return None

    def _loading(self, request: Request) -> bool:
        return (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and request.request_id not in self.finished_recving_kv_req_ids
        )

    def _priority_preemption(self, now: float) -> None:
        challenger = self._challenger() if self.running else None
        if challenger is None or self._can_admit(challenger):
            return
        victim = self.decider.priority_victim(
            self.views[challenger.request_id], [self.views[r.request_id] for r in self.running], now
        )
        if victim is None:
            return
        self.running.remove(victim.request)
        self._reason = "priority"
        try:
            self._preempt_request(victim.request, time.monotonic())
        finally:
            self._reason = "other"

    def _can_admit(self, request: Request) -> bool:
        """preempt's admission test (`Scheduler._can_admit`): a seat, and free blocks for
        the whole current sequence (vLLM's scheduler_reserve_full_isl) or its first chunk."""
        if len(self.running) >= self.max_num_active_reqs:
            return False
        if self.scheduler_reserve_full_isl:
            num_tokens = request.num_tokens
        else:
            num_tokens = request.num_computed_tokens + min(
                request.num_tokens - request.num_computed_tokens, self.max_num_scheduled_tokens
            )
        num_missing = _cdiv(num_tokens, self.block_size) - _cdiv(request.num_computed_tokens, self.block_size)
        return num_missing <= self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        num_dropped = request.num_computed_tokens
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)
        view = self.views.get(request.request_id)
        if view is not None:
            self.decider.on_preempted(view, self._reason, self._step_now, num_dropped)

    def update_from_output(self, scheduler_output, model_runner_output):
        step_s = self.clock.step_duration(self._num_steps - 1)
        self.decider.on_step(
            [self.views[r] for r in scheduler_output.num_scheduled_tokens if r in self.views], step_s
        )
        if self.save_planner is not None:
            self.save_planner.observe_step(scheduler_output.total_num_scheduled_tokens, step_s)
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self.decider.remaining is not None:  # learned lengths: re-estimate who ran
            self.decider.estimate(
                [self.views[r] for r in scheduler_output.num_scheduled_tokens if r in self.requests]
            )
        if len(self.views) > len(self.requests):
            self.views = {rid: view for rid, view in self.views.items() if rid in self.requests}
        if self._export is not None:
            snapshot = self.decider.metrics.snapshot()
            self._export.sync(snapshot)
            self._snapshots.write(snapshot)
        return result

    def plugin_metrics(self) -> dict:
        return self.decider.metrics.snapshot()


class PreemptScheduler(PreemptDecisions, StepLogging, Scheduler):
    """preempt's policy on vLLM's synchronous `Scheduler`."""


class PreemptAsyncScheduler(PreemptDecisions, StepLogging, AsyncScheduler):
    """preempt's policy on vLLM's `AsyncScheduler` (for `async_scheduling`)."""
