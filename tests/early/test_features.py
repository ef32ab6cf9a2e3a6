"""The scale-free features read in a real run (preempt.early.features.engine_features):
the queue counts requests that arrived during the step (not yet queued) and never one
that arrives later; `headroom` is the tighter of the pool and the seats."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.request import RequestState
from preempt.early.features import SCALE_FREE_NAMES, compute_features, engine_features, scale_free_features
from preempt.engine.engine import Engine
from preempt.engine.priority import beats, priority_score
from tests.conftest import make_request, small_config

QUEUE = SCALE_FREE_NAMES.index("queue_share")
HEADROOM = SCALE_FREE_NAMES.index("headroom")


def _run_with_features(requests, **sections):
    config = small_config(model={"backend": "null"}, scheduler={"policy": "priority_score"}, **sections)
    engine = Engine(config)
    seen = []

    def on_step(output):
        view = engine.view
        now = view.now
        queued = {id(r) for r in engine.scheduler.waiting_requests()}
        # Everyone who has arrived by now and waits, read from the requests themselves.
        waiting = [r for r in requests if r.arrival_s <= now and r.state == RequestState.WAITING]
        not_queued = sum(id(r) not in queued for r in waiting)
        scores = [priority_score(r, now, engine.config.preemption.priority_weights) for r in waiting]
        seen.append(
            (
                now,
                engine_features(view, "scale_free"),
                list(view.running),
                view.num_free_blocks,
                scores,
                not_queued,
            )
        )

    engine.run(requests, on_step=on_step)
    return engine, seen


def test_queue_share_counts_arrived_requests_and_never_later_ones():
    # Long low-priority requests fill the seats, VIP challengers arrive mid-step.
    requests = [make_request(i, 40, 200, arrival_s=0.0) for i in range(8)]
    requests += [make_request(8 + i, 20, 10, arrival_s=0.003 + 0.01 * i, sla_level=2) for i in range(12)]
    engine, seen = _run_with_features(requests)
    prefs = engine.config.preemption
    seats = engine.config.scheduler.max_num_seqs
    seen_unqueued_challenger = False
    for now, features, running, _, scores, not_queued in seen:
        for row, request in zip(features, running, strict=True):
            mine = priority_score(request, now, prefs.priority_weights)
            expected = sum(beats(s, mine, prefs.threshold, prefs.score_floor) for s in scores)
            assert row[QUEUE] == np.float32(min(expected / seats, 10.0))
        seen_unqueued_challenger |= not_queued > 0 and features[:, QUEUE].max() > 0
    # Not vacuous: some rows counted a challenger that was not queued yet.
    assert seen_unqueued_challenger


def test_a_challenger_arriving_in_the_step_is_seen_before_its_preemption():
    requests = [make_request(i, 40, 300, arrival_s=0.0) for i in range(8)]
    requests.append(make_request(8, 20, 10, arrival_s=0.05, sla_level=2))
    engine, seen = _run_with_features(requests)
    records = [r for r in engine.scheduler.records if r.reason == "priority"]
    assert records, "the VIP must preempt someone"
    first = records[0]
    # The last row logged before that preemption already counts the challenger for its victim.
    before = [(now, f, running) for now, f, running, *_ in seen if now <= first.time_s]
    now, features, running = before[-1]
    victim = [r.request_id for r in running].index(first.request_id)
    assert features[victim, QUEUE] > 0


def test_headroom_is_the_tighter_of_pool_and_seats():
    requests = [make_request(i, 12, 40, arrival_s=0.0) for i in range(10)]
    engine, seen = _run_with_features(requests)
    seats = engine.config.scheduler.max_num_seqs
    num_blocks = engine.block_pool.num_blocks
    full_seats = 0
    for _, features, running, free, *_ in seen:
        expected = min(free / num_blocks, max(0, seats - len(running)) / seats)
        np.testing.assert_allclose(features[:, HEADROOM], expected, rtol=1e-6)
        full_seats += len(running) == seats and free > 0
    assert full_seats > 0  # rows where the pool has room and the seats do not: headroom 0


def _reference_scale_free(running, waiting_scores, now, free, num_blocks, block_size, seats, prefs):
    """The scale-free columns computed the first way: the `v1` columns, rescaled."""
    v1 = compute_features(running, waiting_scores, now, free, num_blocks, prefs)
    out = v1.copy()
    held = np.array([len(r.block_ids) for r in running], np.float32)
    out[:, 1] = held / num_blocks
    out[:, 3] = v1[:, 3] / max(1, len(running) - 1)
    final = np.array([r.num_prompt_tokens + r.max_tokens for r in running], np.float32)
    out[:, 5] = np.minimum(np.maximum(0.0, np.ceil(final / block_size) - held) / max(1, free), 10.0)
    out[:, 6] = np.minimum(v1[:, 6] / seats, 10.0)
    out[:, 7] = min(free / num_blocks, max(0, seats - len(running)) / seats)
    return out


@pytest.mark.parametrize("strategy", ["dynamic", "static"])
def test_the_one_pass_scale_free_features_equal_the_v1_columns_rescaled(strategy):
    rng = np.random.default_rng(3)
    requests = [
        make_request(
            i, int(rng.integers(4, 700)), int(rng.integers(2, 60)), arrival_s=0.002 * i, sla_level=i % 3
        )
        for i in range(40)
    ]
    config = small_config(
        model={"backend": "null"},
        scheduler={"policy": "priority_score"},
        preemption={"time_slice_strategy": strategy},
    )
    engine = Engine(config)
    prefs = engine.config.preemption
    compared = 0

    def on_step(output):
        view = engine.view
        now = view.now
        waiting = view.waiting_scores(now)
        args = (
            view.running,
            waiting,
            now,
            view.num_free_blocks,
            view.num_blocks,
            view.block_size,
            view.max_num_seqs,
        )
        fast = scale_free_features(*args, prefs)
        np.testing.assert_array_equal(fast, _reference_scale_free(*args, prefs))
        nonlocal compared
        compared += len(view.running)

    engine.run(requests, on_step=on_step)
    assert compared > 100
