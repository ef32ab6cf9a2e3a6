"""The cheap forecast (preempt.early.projection): it reads the live engine without
changing it, names what the fork's forecast names, and as an early-save policy saves
early without changing any output."""

from __future__ import annotations

import pytest

from preempt.core.request import RequestState
from preempt.early.lookahead import Lookahead
from preempt.early.projection import Projection
from preempt.engine.engine import Engine
from tests.early.test_lookahead import _config, _loose_workload, _run_policy, _trace
from tests.kv.test_preemption import _digests


def test_projecting_leaves_the_live_engine_untouched():
    plain = _trace(Engine(_config()), _loose_workload())
    projection = Projection(horizon_ms=20.0, horizon_steps=3)
    projected = _trace(Engine(_config()), _loose_workload(), hook=lambda e: projection.forecast(e.view, 0.01))
    assert projection.num_calls > 50
    assert projected == plain
    assert plain[3]["num_preemptions"] >= 10, "the workload must preempt"


@pytest.mark.parametrize("loose", [False, True])
def test_the_projection_names_what_the_fork_names(loose):
    """At every step, the requests preempted within the horizon: the projection against
    the fork that knows only the present (both run requests to max_tokens). Measured on
    this workload: exact lengths, all of the fork's names and no extra; max_tokens 40 above
    the true lengths, likewise (13 and 15 names) (scripts/projection_agreement.py: 0.961 over four held-out
    azure-conv windows, 9.6% extra)."""
    fork = Lookahead(horizon_ms=20.0, horizon_steps=3, knows_future=False)
    cheap = Projection(horizon_ms=20.0, horizon_steps=3)
    counts = {"fork": 0, "both": 0, "cheap": 0}

    def compare(engine) -> None:
        view = engine.view
        if not view.running:
            return
        want = fork.within(fork.forecast(view))
        got = cheap.within(cheap.forecast(view, 0.01))
        counts["fork"] += len(want)
        counts["cheap"] += len(got)
        counts["both"] += len(want & got)

    from tests.kv.test_preemption import _workload

    _trace(Engine(_config()), _loose_workload() if loose else _workload(), hook=compare)
    assert counts["fork"] >= 10, counts
    assert counts["both"] >= 0.95 * counts["fork"], counts
    assert counts["cheap"] - counts["both"] <= 0.1 * counts["cheap"], counts


def test_the_projection_policy_saves_early_and_keeps_outputs():
    _, requests = _run_policy("none")
    engine, early_requests = _run_policy("projection")
    assert all(r.state is RequestState.FINISHED for r in early_requests)
    assert _digests(early_requests) == _digests(requests)
    early = engine.saver.early
    assert early.num_early_saves > 0 and early.early_bytes_used > 0
    stats = engine.stats()
    assert stats["projection_calls"] > 0


def test_the_projection_runs_on_the_wall_clock():
    from tests.conftest import small_config

    # no fork, so no virtual clock needed (the lookahead policies refuse the wall clock)
    config = small_config(
        clock={"kind": "wall"}, preemption={"mode": "swap"}, early_save={"policy": "projection"}
    )
    assert config.early_save.policy == "projection"


def test_the_projection_ends_requests_where_it_is_told():
    """`end_of`: where each request leaves the projection. Told that every request ends at
    its next token, nothing is preempted past the next schedule (which comes before any
    token); told the true lengths, it names no more than with max_tokens on the loose
    workload (requests end sooner, freeing what a preemption needed)."""
    told_now = Projection(20.0, 3, end_of=lambda r: r.num_output_tokens + 1)
    told_true = Projection(20.0, 3, end_of=lambda r: r.output_limit)
    plain = Projection(20.0, 3)
    counts = {"now_later": 0, "plain": 0, "true": 0}

    def compare(engine) -> None:
        view = engine.view
        if not view.running:
            return
        counts["now_later"] += sum(
            1 for _, steps in told_now.forecast(view, 0.01).preempted.values() if steps > 1
        )
        counts["plain"] += len(plain.within(plain.forecast(view, 0.01)))
        counts["true"] += len(told_true.within(told_true.forecast(view, 0.01)))

    _trace(Engine(_config()), _loose_workload(), hook=compare)
    assert counts["now_later"] == 0 and counts["plain"] >= 10
    assert counts["true"] <= counts["plain"], counts
