"""The waiting queue: how waiting requests are ordered for admission.

Owns: every request that waits for a seat (new arrivals and preempted requests, paused
ones included), in the order the scheduling policy admits them: by the policy's
`admission_key` (smaller first), equal keys first in, first out. Plain Python, no torch.
Both schedulers (`Scheduler`, `SglangScheduler`) admit from it, the engine's observers
read it (restore prefetch asks for the next heads, the feature logger and early-save
policies for everyone's priority score), and an engine fork copies it.

A binary heap of `(key, sequence number, request)` entries: the sequence number, unique
and increasing, keeps equal keys FIFO and stops heapq from ever comparing requests. A
key is computed when a request enters and changes only through `rekey` (a policy that
moves waiting requests: FastServe's starvation promotion, SRPT's starvation guard).
Beside the heap, each request's score part that does not move while it waits is cached,
so that scoring the whole queue at a time `now` is one numpy expression (`scores`) rather
than one score each.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Collection, Iterator

import numpy as np

from preempt.core.config import PriorityWeights
from preempt.core.request import Request
from preempt.engine.priority import priority_scores, remaining_ktokens


class WaitingQueue:
    """Waiting requests in admission order (the policy's key, then FIFO)."""

    def __init__(self, key: Callable[[Request], tuple], weights: PriorityWeights) -> None:
        self._key = key  # the policy's `admission_key`
        self._weights = weights  # the priority score's, for `scores`
        self._heap: list[tuple[tuple, int, Request]] = []
        self._score_parts: dict[Request, float] = {}  # queued request -> `_score_part`
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Admission order, over a snapshot: the caller may push, pop or discard meanwhile."""
        return iter([entry[2] for entry in sorted(self._heap)])

    def in_order(self, keep: Callable[[Request], bool]) -> list[Request]:
        """The queued requests `keep` accepts, in admission order: sorts only those (a
        queue of thousands behind a head that does not fit is scanned, not sorted)."""
        return [entry[2] for entry in sorted(entry for entry in self._heap if keep(entry[2]))]

    def unordered(self) -> Iterator[Request]:
        """Every queued request in no particular order (heap order: no sort)."""
        for entry in self._heap:
            yield entry[2]

    # ----------------------------------------------------------------- changes
    def push(self, request: Request) -> None:
        """Queue `request`, behind every queued request with the same key."""
        heapq.heappush(self._heap, (self._key(request), self._next_seq, request))
        self._next_seq += 1
        self._score_parts[request] = self._score_part(request)

    def would_lead(self, key: tuple) -> bool:
        """Whether a request with admission key `key`, pushed now, would be the head (a key
        before the head's; an empty queue)."""
        return not self._heap or key < self._heap[0][0]

    def peek(self) -> Request:
        """The head: the next request to admit (IndexError when empty)."""
        return self._heap[0][2]

    def pop(self) -> Request:
        """Take the head out (IndexError when empty)."""
        request = heapq.heappop(self._heap)[2]
        del self._score_parts[request]
        return request

    def discard(self, request: Request) -> None:
        """Take `request` out wherever it is queued (nothing if it is not queued)."""
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        self._score_parts.pop(request, None)
        heapq.heapify(self._heap)

    def rekey(self, requests: Collection[Request]) -> None:
        """Recompute the keys of these queued requests (the policy moved them: FastServe's
        starvation promotion, SRPT's starvation guard); sequence numbers stay, so equal
        keys keep their first-in order. Each moved entry is sifted into place (O(n) to
        find it, O(log n) to place it), not the whole queue re-keyed and heapified."""
        heap = self._heap
        if len(requests) > 16:  # many: one pass
            moved = set(requests)
            self._heap = [(self._key(r), seq, r) if r in moved else (key, seq, r) for key, seq, r in heap]
            heapq.heapify(self._heap)
            return
        for request in requests:
            index = next((i for i, entry in enumerate(heap) if entry[2] is request), None)
            if index is not None:
                heap[index] = (self._key(request), heap[index][1], request)
                _resift(heap, index)

    def rescore(self, request: Request) -> None:
        """Recompute a queued request's cached score part (its remaining work changed:
        a paused request whose KV was saved or dropped)."""
        if request in self._score_parts:
            self._score_parts[request] = self._score_part(request)

    # ----------------------------------------------------------------- observers
    def next_to_admit(self, k: int) -> list[Request]:
        """The first `k` requests in admission order, read-only. Walks the heap from its
        root, a frontier of the children of what it took: O(k log k), not O(n) as
        `nsmallest` is (the projection asks for a few heads of thousands every step).
        Entries are unique (the sequence number), so the order is exactly the sorted one."""
        heap = self._heap
        out: list[Request] = []
        frontier = [(heap[0], 0)] if heap and k > 0 else []
        while frontier and len(out) < k:
            entry, index = heapq.heappop(frontier)
            out.append(entry[2])
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return out

    def scores(self, now: float) -> np.ndarray:
        """priority scores of every queued request at `now`, (N,) float64, in no
        particular order: score = cached part + now * w_age, O(N) numpy."""
        weights = self._weights
        if weights.age_cap_s is not None:  # the age term is not linear in `now`: score each
            return priority_scores(list(self._score_parts), now, weights)
        parts = np.fromiter(self._score_parts.values(), dtype=np.float64, count=len(self._score_parts))
        return parts + now * weights.age

    def _score_part(self, request: Request) -> float:
        """The part of a waiting request's score that does not move while it waits
        (score = this + now * w_age): its remaining work is fixed until it runs again."""
        weights = self._weights
        return (
            request.sla_level * weights.sla
            - remaining_ktokens(request) * weights.tokens
            - request.arrival_s * weights.age
        )

    # ----------------------------------------------------------------- fork
    def __deepcopy__(self, memo: dict[int, object]) -> WaitingQueue:
        """A copy (an engine fork's): the same order and sequence numbers, its own heap and
        cache. Keys (tuples of numbers) and the weights (config, never written) are shared;
        requests and the key's policy map through `memo`, so every reference to a request
        in the copied engine finds the same copy."""
        forked = object.__new__(WaitingQueue)
        memo[id(self)] = forked
        forked._key = copy.deepcopy(self._key, memo)
        forked._weights = self._weights
        forked._heap = [(key, seq, copy.deepcopy(request, memo)) for key, seq, request in self._heap]
        forked._score_parts = {copy.deepcopy(r, memo): part for r, part in self._score_parts.items()}
        forked._next_seq = self._next_seq
        return forked


def _resift(heap: list, index: int) -> None:
    """Restore the heap order around `index`, whose entry changed either way: toward the
    root while smaller than its parent, else away from it while larger than a child.
    Entries never tie (the sequence number), so `<` decides every comparison."""
    entry = heap[index]
    while index > 0 and entry < heap[(index - 1) >> 1]:
        heap[index] = heap[(index - 1) >> 1]
        index = (index - 1) >> 1
    size = len(heap)
    child = 2 * index + 1
    while child < size:
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if not heap[child] < entry:
            break
        heap[index] = heap[child]
        index = child
        child = 2 * index + 1
    heap[index] = entry
