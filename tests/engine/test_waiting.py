"""The waiting queue on its own: admission order (key, then first in), taking requests
out, re-keying, iteration, the score cache, and a fork's independence."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from preempt.core.config import PriorityWeights
from preempt.engine.priority import priority_scores
from preempt.engine.waiting import WaitingQueue
from tests.conftest import make_request

WEIGHTS = PriorityWeights(age=0.3, sla=0.8, tokens=0.5)


def by_level(request):
    return (-request.sla_level,)  # higher level first


def queue_of(levels: list[int], key=by_level) -> tuple[WaitingQueue, list]:
    queue = WaitingQueue(key, WEIGHTS)
    requests = [make_request(i, 4, 3, arrival_s=float(i), sla_level=level) for i, level in enumerate(levels)]
    for request in requests:
        queue.push(request)
    return queue, requests


def ids(requests) -> list[int]:
    return [r.request_id for r in requests]


def drain(queue: WaitingQueue) -> list[int]:
    out = []
    while queue:
        assert queue.peek() is not None
        out.append(queue.pop().request_id)
    return out


def test_order_is_key_then_first_in():
    queue, _ = queue_of([0, 2, 0, 2, 1, 0])
    assert len(queue) == 6
    assert queue.peek().request_id == 1
    assert drain(queue) == [1, 3, 4, 0, 2, 5]
    assert len(queue) == 0 and not queue


def test_iteration_and_next_to_admit_are_the_pop_order():
    rng = random.Random(0)
    queue, _ = queue_of([rng.randrange(4) for _ in range(200)])
    order = ids(queue)
    for k in (0, 1, 2, 7, 64, 200, 500):
        assert ids(queue.next_to_admit(k)) == order[:k]
    assert ids(queue) == order  # read-only
    assert sorted(ids(queue.unordered())) == list(range(200))
    assert drain(queue) == order


def test_iteration_is_a_snapshot():
    queue, requests = queue_of([0, 0, 0])
    seen = []
    for request in queue:
        seen.append(request.request_id)
        queue.discard(request)
    assert seen == [0, 1, 2] and not queue


def test_discard_takes_out_one_and_keeps_the_rest_in_order():
    queue, requests = queue_of([1, 0, 1, 0])
    queue.discard(requests[2])
    assert ids(queue) == [0, 1, 3]
    queue.discard(requests[2])  # no longer queued: nothing happens
    assert len(queue) == 3 and len(queue.scores(0.0)) == 3
    assert drain(queue) == [0, 1, 3]


def test_rekey_follows_the_new_keys_and_keeps_ties_first_in():
    boost: dict[int, int] = {}

    def key(request):
        return (-boost.get(request.request_id, 0),)

    queue, requests = queue_of([0, 0, 0, 0], key=key)
    assert ids(queue) == [0, 1, 2, 3]
    boost.update({3: 1, 2: 1})
    assert ids(queue) == [0, 1, 2, 3]  # keys are read when a request enters
    queue.rekey([requests[3], requests[2]])
    assert ids(queue) == [2, 3, 0, 1]


@pytest.mark.parametrize("num_moved", [1, 3, 40])  # sifted one by one, or many in one pass
def test_rekey_of_some_keeps_the_order_a_fresh_sort_gives(num_moved):
    rng = random.Random(num_moved)
    keys = {index: rng.randrange(10) for index in range(100)}
    queue, requests = queue_of([0] * 100, key=lambda request: (keys[request.request_id],))
    for _ in range(20):
        moved = rng.sample(requests, num_moved)
        for request in moved:  # up or down
            keys[request.request_id] = rng.randrange(10)
        queue.rekey(moved + [make_request(999, 4, 3)])  # one not queued: ignored
        # FIFO among equal keys: by queue order of entry (sequence number = request id here)
        assert ids(queue) == sorted(range(100), key=lambda index: (keys[index], index))


def test_scores_track_the_queue():
    queue, requests = queue_of([0, 2, 1, 3])
    queue.pop()
    queue.discard(requests[0])
    left = list(queue)
    np.testing.assert_allclose(np.sort(queue.scores(7.5)), np.sort(priority_scores(left, 7.5, WEIGHTS)))
    left[0].output_token_ids.extend([5, 5])  # less work left: its cached part must move
    queue.rescore(left[0])
    np.testing.assert_allclose(np.sort(queue.scores(7.5)), np.sort(priority_scores(left, 7.5, WEIGHTS)))


class _Policy:
    """A key that reads the policy's own state, as FastServe's does."""

    def __init__(self) -> None:
        self.level: dict[int, int] = {}

    def admission_key(self, request):
        return (self.level.get(request.request_id, 0),)


def test_a_fork_is_independent_and_keys_by_its_own_policy():
    policy = _Policy()
    queue, requests = queue_of([0, 0, 0, 0], key=policy.admission_key)
    memo = {id(r): copy.copy(r) for r in requests}  # the engine's fork copies requests first
    memo[id(policy)] = forked_policy = copy.deepcopy(policy)
    fork = copy.deepcopy(queue, memo)
    assert [r.request_id for r in fork] == [0, 1, 2, 3]
    assert all(f is memo[id(r)] for f, r in zip(fork, queue, strict=True))

    fork.pop()
    fork.discard(memo[id(requests[2])])
    fork.push(make_request(9, 4, 3))
    assert ids(queue) == [0, 1, 2, 3] and len(queue.scores(0.0)) == 4
    assert ids(fork) == [1, 3, 9] and len(fork.scores(0.0)) == 3

    forked_policy.level[3] = -1  # re-keying the fork reads the fork's policy only
    fork.rekey(list(fork))
    queue.rekey(list(queue))
    assert ids(fork) == [3, 1, 9]
    assert ids(queue) == [0, 1, 2, 3]

    queue.push(make_request(8, 4, 3))  # sequence numbers continue apart
    assert ids(queue)[-1] == 8 and 8 not in ids(fork)


def test_a_policy_whose_on_step_returns_true_has_the_whole_queue_re_keyed():
    """A policy written when `on_step` returned a bool still works: True re-keys all."""
    from preempt.core.block_pool import BlockPool
    from preempt.core.config import PreemptionConfig, SchedulerConfig
    from preempt.engine.policies import SchedulingPolicy
    from preempt.engine.scheduler import Scheduler, SchedulerOutput

    class Flip(SchedulingPolicy):
        flipped = False

        def admission_key(self, request):
            return (-request.request_id if self.flipped else request.request_id,)

        def select_victim(self, running, now):
            return running[-1]

        def on_step(self, ran, step_s, now):
            self.flipped = True
            return True

    scheduler = Scheduler(SchedulerConfig(), Flip(PreemptionConfig()), BlockPool(8), block_size=4)
    for index in range(3):
        scheduler.add_request(make_request(index, 4, 3))
    assert ids(scheduler.waiting) == [0, 1, 2]
    scheduler.update_from_output(SchedulerOutput([], [], [], 0, 0.0), 0.01, [], 0.01)
    assert ids(scheduler.waiting) == [2, 1, 0]
