"""Continuous batching: which requests run this step, with how many tokens, and who
gets preempted when KV blocks run out.

Owns: the waiting queue, the running list, block allocation for scheduled tokens, and
recompute preemption (vLLM V1's only mode: free the victim's blocks, forget its KV,
requeue it). Plain Python, no torch. It never runs the model and never reads a clock of
its own: `schedule()` is a pure decision over the state it is given.

One step (`schedule`):
1. Running requests, in admission order, each get their next tokens (1 for decode, a
   chunk of the prompt otherwise) within the step's token budget. When blocks run out,
   the policy picks a victim among the running requests and it is preempted by
   recompute; if the victim is the requester itself, the requester waits.
2. Only if nobody was preempted, waiting requests are admitted in policy order while the
   budget, `max_num_seqs` and free blocks allow. The head of the queue is never skipped.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

from preempt.block_pool import BlockPool, blocks_needed
from preempt.config import SchedulerConfig
from preempt.policies import SchedulingPolicy
from preempt.request import Request, RequestState, ScheduledChunk


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]  # what to compute this step, running order
    preempted: list[Request]  # recompute victims of this step
    num_batched_tokens: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        policy: SchedulingPolicy,
        block_pool: BlockPool,
        block_size: int,
    ) -> None:
        self.config = config
        self.policy = policy
        self.block_pool = block_pool
        self.block_size = block_size
        self.running: list[Request] = []  # admission order, oldest first
        # Heap of (policy key, insertion counter, request): the counter keeps equal keys
        # FIFO and stops heapq from ever comparing Request objects.
        self._waiting: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting)

    def add_request(self, request: Request) -> None:
        request.state = RequestState.WAITING
        heapq.heappush(self._waiting, (self.policy.admission_key(request), next(self._counter), request))

    def waiting_requests(self) -> list[Request]:
        """Waiting requests in admission order (a copy; for inspection and tests)."""
        return [entry[2] for entry in sorted(self._waiting)]

    # ----------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: dict[int, ScheduledChunk] = {}  # id(request) -> chunk, insertion ordered
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen for live requests)
                index += 1
                continue
            while not self._allocate_for(request, num_new):
                victim = self.policy.select_victim(self.running)
                victim_chunk = chunks.pop(id(victim), None)
                if victim_chunk is not None:  # refund a victim scheduled earlier this step
                    budget += victim_chunk.num_new_tokens
                victim_index = self.running.index(victim)
                self._preempt_by_recompute(victim)
                preempted.append(victim)
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            else:
                chunks[id(request)] = ScheduledChunk(request, num_new)
                budget -= num_new
                index += 1

        if not preempted:
            budget = self._admit_waiting(chunks, budget)

        chunk_list = list(chunks.values())
        num_tokens = sum(chunk.num_new_tokens for chunk in chunk_list)
        return SchedulerOutput(chunk_list, preempted, num_tokens)

    def _admit_waiting(self, chunks: dict[int, ScheduledChunk], budget: int) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._waiting[0][2]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_for(request, num_new):
                break  # FCFS-style head-of-line blocking: never skip the head
            heapq.heappop(self._waiting)
            request.state = RequestState.RUNNING
            self.running.append(request)
            chunks[id(request)] = ScheduledChunk(request, num_new)
            budget -= num_new
        return budget

    def _allocate_for(self, request: Request, num_new: int) -> bool:
        """Grow the request's block table to cover `num_new` more tokens, if possible."""
        num_missing = blocks_needed(request.num_computed_tokens + num_new, self.block_size) - len(
            request.block_ids
        )
        if num_missing <= 0:
            return True
        if not self.block_pool.can_allocate(num_missing):
            return False
        request.block_ids.extend(self.block_pool.allocate(num_missing))
        return True

    def _preempt_by_recompute(self, request: Request) -> None:
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add_request(request)

    # ----------------------------------------------------------------- exits
    def finish_request(self, request: Request, state: RequestState) -> None:
        """Take a running or waiting request out for good and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            self._waiting = [entry for entry in self._waiting if entry[2] is not request]
            heapq.heapify(self._waiting)
        self._release_blocks(request)
        request.state = state

    def remove_finished(self, finished: list[Request]) -> None:
        """Batch version of `finish_request(r, FINISHED)` for running requests (one pass
        over the running list per step instead of one per request)."""
        if not finished:
            return
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for request in finished:
            self._release_blocks(request)
            request.state = RequestState.FINISHED

    def _release_blocks(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
