"""The lookahead oracle: a fork of the engine leaves the live one untouched, and what it
forecasts is what the live run then does (a true upper bound, measured in the run)."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.config import ConfigError
from preempt.core.request import RequestState
from preempt.early.lookahead import Lookahead
from preempt.engine.engine import Engine
from preempt.obs.dataset import preemption_events
from tests.conftest import small_config
from tests.kv.test_preemption import AGGRESSIVE, _digests, _workload


def _config(backend: str = "tiny", **early):
    return small_config(
        model={"backend": backend},
        cache={"num_blocks": 48},  # tight: memory preemptions too
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": "swap_zstd", **AGGRESSIVE},
        early_save=early,
    )


def _trace(engine, requests, hook=None):
    """Everything observable of a run: outputs, per-step schedule, records, clock, stats."""
    steps = []

    def on_step(output):
        steps.append(
            (
                tuple((c.request.request_id, c.num_new_tokens) for c in output.scheduled.chunks),
                tuple(r.request_id for r in output.scheduled.preempted),
                output.step_s,
                output.stall_s,
                engine.clock.now(),
            )
        )
        if hook is not None:
            hook(engine)

    engine.run(requests, on_step=on_step)
    records = [
        (r.time_s, r.request_id, r.reason, r.action, r.bytes_raw, r.restore_s)
        for r in engine.scheduler.records
    ]
    return _digests(requests), steps, records, engine.stats()


@pytest.mark.parametrize("knows_future", [True, False])
def test_forking_and_simulating_ahead_leaves_the_live_engine_untouched(knows_future):
    # Loose max_tokens: the forecast rewrites its copies' lengths, which must not reach
    # the live requests (they would run 40 tokens longer).
    plain = _trace(Engine(_config()), _loose_workload())
    engine = Engine(_config())
    lookahead = Lookahead(horizon_ms=20.0, horizon_steps=3, knows_future=knows_future)
    forked = _trace(engine, _loose_workload(), hook=lookahead.forecast)
    assert lookahead.num_forks > 50 and lookahead.num_fork_steps > lookahead.num_forks
    assert forked == plain
    assert plain[3]["num_preemptions"] >= 10, "the workload must preempt"


def _loose_workload():
    """`_workload` with every `max_tokens` 40 above the true length (a server's cap)."""
    requests = _workload()
    for request in requests:
        request.max_tokens = request.target_output_tokens + 40
    return requests


def test_a_fork_is_a_copy():
    engine = Engine(_config())
    requests = _workload()
    for request in requests[:8]:
        engine.add_request(request)
    for _ in range(5):
        engine.step()
    fork = engine.fork()
    assert fork.scheduler is not engine.scheduler and fork.block_pool is not engine.block_pool
    assert [r.request_id for r in fork.scheduler.running] == [r.request_id for r in engine.scheduler.running]
    assert all(a is not b for a, b in zip(fork.scheduler.running, engine.scheduler.running, strict=True))
    assert fork.block_pool.num_free == engine.block_pool.num_free and fork.early_saver is None
    before = [(r.num_computed_tokens, list(r.block_ids)) for r in engine.scheduler.running]
    for _ in range(10):
        fork.step()
    assert [(r.num_computed_tokens, list(r.block_ids)) for r in engine.scheduler.running] == before


@pytest.mark.parametrize("backend", ["null", "tiny"])
def test_the_forecast_is_what_the_live_run_does(backend):
    """Without early saves the live engine follows the fork step for step: at every step,
    the preemptions the fork saw within the horizon are exactly the live run's."""
    engine = Engine(_config(backend))
    lookahead = Lookahead(horizon_ms=15.0, horizon_steps=4)
    forecasts = []

    def hook(engine):
        forecasts.append((engine.clock.now(), engine.num_steps, lookahead.forecast(engine.view)))

    _trace(engine, _workload(), hook=hook)
    events = preemption_events(engine.scheduler.records)
    assert sum(len(t) for t in events.values()) >= 10
    step_ends = np.asarray([t for t, _, _ in forecasts])
    checked = 0
    for t_s, _, forecast in forecasts:
        truth = {}
        for rid, times in events.items():
            later = times[times >= t_s - 1e-12]
            if len(later):
                dt = later[0] - t_s
                steps = 1 + int(np.count_nonzero((step_ends > t_s + 1e-12) & (step_ends <= later[0] + 1e-12)))
                if dt <= lookahead.horizon_s + 1e-9 or steps <= lookahead.horizon_steps:
                    truth[rid] = (dt, steps)
        got = {rid: v for rid, v in forecast.preempted.items() if rid in lookahead.within(forecast)}
        assert set(got) == set(truth), t_s
        for rid, (dt, steps) in truth.items():
            assert got[rid][0] == pytest.approx(dt, abs=1e-9) and got[rid][1] == steps
        checked += len(truth)
    assert checked >= 10


def test_the_forecast_knows_only_the_present():
    """`knows_future=False`: the VIPs of this workload, arriving every 15 ms, are
    challengers the oracle sees coming and the forecast does not (so the two differ, and
    the forecast warns of fewer preemptions)."""
    engine = Engine(_config("null"))
    oracle = Lookahead(horizon_ms=20.0, horizon_steps=3)
    forecast = Lookahead(horizon_ms=20.0, horizon_steps=3, knows_future=False)
    seen = {"oracle": 0, "forecast": 0, "oracle_only": 0}

    def hook(engine):
        told = oracle.within(oracle.forecast(engine.view))
        guessed = forecast.within(forecast.forecast(engine.view))
        seen["oracle"] += len(told)
        seen["forecast"] += len(guessed)
        seen["oracle_only"] += len(told - guessed)

    _trace(engine, _workload(), hook=hook)
    assert seen["oracle_only"] > 0 and seen["forecast"] < seen["oracle"]


def test_the_forecast_reads_max_tokens_not_the_true_lengths():
    """Two workloads the server cannot tell apart (same prompts, arrivals, `max_tokens`),
    one whose requests really stop 40 tokens short of `max_tokens`: the oracle's forks
    see different futures, the forecast the same one (every request run to max_tokens)."""

    def first_step(shorter):
        requests = _workload()
        for request in requests:
            request.max_tokens = request.target_output_tokens + 40
            if not shorter:
                request.target_output_tokens = request.max_tokens
        engine = Engine(_config("null"))
        for request in requests:
            engine.add_request(request)
        engine.step()
        return engine.view

    def forecasts(knows_future):
        return [
            Lookahead(horizon_ms=400.0, knows_future=knows_future).forecast(first_step(shorter))
            for shorter in (True, False)
        ]

    truth_short, truth_long = forecasts(knows_future=True)
    assert truth_short != truth_long
    guess_short, guess_long = forecasts(knows_future=False)
    assert guess_short == guess_long and guess_long.preempted
    assert guess_long == truth_long  # the long workload's truth *is* its max_tokens


def test_the_forecast_forks_again_on_news_only():
    """With a fork allowed once in a million steps, the oracle forks once (it knew every
    arrival); the forecast forks at its first decision and then exactly at the decisions
    that follow news: a request arrived since its last fork (16 VIPs, every 15 ms), or
    one ended short of its max_tokens (every request of the loose workload). The news is
    counted here from the run's own events, not from the policy's bookkeeping."""

    def run(policy, workload):
        requests = workload()
        arrivals = sorted(r.arrival_s for r in requests)
        engine = Engine(_config("null", policy=policy, lookahead_every_steps=10**6))
        expected = {"forks": 0, "known": -1, "short_finish": False}

        def on_step(output):
            expected["short_finish"] |= any(r.num_output_tokens < r.max_tokens for r in output.finished)
            if not output.scheduled.chunks or not engine.scheduler.running:
                return  # the early saver decides nothing after this step
            arrived = sum(1 for t in arrivals if t <= engine.clock.now())
            if expected["forks"] == 0 or arrived != expected["known"] or expected["short_finish"]:
                expected["forks"] += 1
                expected["known"], expected["short_finish"] = arrived, False

        engine.run(requests, on_step=on_step)
        return engine.early_saver.policy.lookahead.num_forks, expected["forks"]

    assert run("lookahead", _workload)[0] == 1
    forks, expected = run("forecast", _workload)
    assert forks == expected and forks > 10  # the VIPs' arrival steps
    loose, expected_loose = run("forecast", _loose_workload)
    assert loose == expected_loose and loose > forks  # early finishes are news too


@pytest.mark.parametrize("policy", ["lookahead", "forecast"])
def test_the_lookahead_policy_saves_early_and_keeps_outputs(policy):
    _, requests = _run_policy("none")
    engine, early_requests = _run_policy(policy)
    assert all(r.state is RequestState.FINISHED for r in early_requests)
    assert _digests(early_requests) == _digests(requests)
    saver = engine.saver
    assert saver.early.num_early_saves > 0 and saver.early.early_bytes_used > 0
    assert saver.early.early_bytes_used + saver.early.early_bytes_wasted == saver.early.early_bytes_raw


def _run_policy(policy):
    engine = Engine(_config(policy=policy))
    requests = _workload()
    engine.run(requests)
    return engine, requests


@pytest.mark.parametrize("policy", ["lookahead", "forecast"])
def test_the_lookahead_needs_the_virtual_clock(policy):
    with pytest.raises(ConfigError, match="virtual"):
        small_config(clock={"kind": "wall"}, preemption={"mode": "swap"}, early_save={"policy": policy})


def test_the_forecast_feature_is_the_forks_lead_and_the_rest_is_scale_free():
    """The `forecast` set: 7 columns as `scale_free`, and in sla_level's slot 1/k where
    the last fork preempts the request k steps ahead. Checked against the live run
    (which, without early saves, follows the fork until a request arrives): a lead of
    1/k is a preemption k steps later unless an arrival came first, and right after each
    fork every live preemption within the step horizon with no arrival first has its
    lead. Computing the set leaves the run untouched."""
    from preempt.early.features import FORECAST_NAMES, SCALE_FREE_NAMES, Features, engine_features

    slot = FORECAST_NAMES.index("forecast_lead")
    assert slot == SCALE_FREE_NAMES.index("sla_level")
    engine = Engine(_config("null"))
    features = Features("forecast", horizon_ms=15.0, horizon_steps=3)
    calls = []

    def hook(engine):
        view = engine.view
        if not view.running:
            return
        forks = features.rolling.lookahead.num_forks
        out = features(view)
        plain = engine_features(view, "scale_free")
        np.testing.assert_array_equal(np.delete(out, slot, axis=1), np.delete(plain, slot, axis=1))
        forked = features.rolling.lookahead.num_forks > forks
        leads = {r.request_id: float(out[i, slot]) for i, r in enumerate(view.running)}
        calls.append((view.num_steps, view.now, forked, leads))

    requests = _workload()
    traced = _trace(engine, requests, hook=hook)
    assert traced == _trace(Engine(_config("null")), _workload())
    step_end = {n: t for n, t, _, _ in calls}
    arrivals = np.asarray(sorted(r.arrival_s for r in requests))
    events = preemption_events(engine.scheduler.records)

    def live_ahead(rid, n, t_n):
        """(k, seconds): the live run preempts `rid` at the schedule of step n + k, that
        long after step n ended ((None, inf): never again)."""
        later = events.get(rid, np.zeros(0))
        later = later[later >= t_n - 1e-12]
        if not len(later):
            return None, np.inf
        k = 1 + sum(1 for m, t in step_end.items() if m > n and t_n + 1e-12 < t <= later[0] + 1e-12)
        return k, later[0] - t_n

    def quiet(n, k, t_n):
        """No request arrived from step n's end to step n + k's."""
        until = step_end.get(n + k, np.inf)
        return not np.any((arrivals > t_n + 1e-12) & (arrivals <= until + 1e-12))

    warned = told = 0
    for n, t_n, forked, leads in calls:
        for rid, lead in leads.items():
            if lead > 0:
                k = round(1 / lead)
                assert lead == pytest.approx(1 / k)
                if quiet(n, k, t_n):
                    assert live_ahead(rid, n, t_n)[0] == k, (n, rid)
                    warned += 1
            elif forked:  # not preempted within the horizon (3 steps or 15 ms), or news came first
                k, dt = live_ahead(rid, n, t_n)
                assert k is None or (k > 3 and dt > 0.015 + 1e-9) or not quiet(n, k, t_n), (n, rid)
        told += forked
    assert warned >= 10 and told > len(calls) / 4  # reforked on arrivals beyond every 4th call


def test_the_forecast_feature_set_needs_the_virtual_clock(tmp_path, capsys):
    from preempt.cli import main

    with pytest.raises(ConfigError, match="feature_set 'forecast'.*virtual"):
        small_config(
            clock={"kind": "wall"},
            preemption={"mode": "swap"},
            early_save={"policy": "lstm", "checkpoint": "x.ckpt", "feature_set": "forecast"},
        )
    args = ["collect", "--out", str(tmp_path / "r"), "--features", str(tmp_path / "f"), "--no-progress"]
    args += ["--set", "features.feature_set=forecast", "--set", "clock.kind=wall"]
    assert main(args) == 2
    assert "features.feature_set" in capsys.readouterr().err


def test_rolling_forecast_forks_every_n_calls_and_at_once_on_news():
    """The cadence alone, on a stand-in lookahead: forks at the 1st call and every 4th
    after; for a forecast also at the call after an arrival or a finish short of its
    max_tokens (a full-length finish is no news), and the count restarts there. The
    oracle (it knew the future) takes neither as news."""
    from types import SimpleNamespace

    from preempt.early.lookahead import Forecast, RollingForecast

    def run(knows_future, events):
        forks = []
        stand_in = SimpleNamespace(knows_future=knows_future)
        stand_in.forecast = lambda view: forks.append(view.num_steps) or Forecast({7: (0.0, 2)}, 2, 0.0)
        stand_in.within = lambda forecast: set(forecast.preempted)
        rolling = RollingForecast(stand_in, every_steps=4)
        arrived = 0
        for call in range(1, 13):
            arrived += events.get(call) == "arrival"
            if events.get(call) in ("short", "full"):
                output = 10 if events[call] == "short" else 20
                rolling.note_finished([SimpleNamespace(num_output_tokens=output, max_tokens=20)])
            rolling.update(SimpleNamespace(num_arrived=arrived, num_steps=call))
        return forks, rolling

    assert run(False, {})[0] == [1, 5, 9]
    assert run(False, {3: "arrival"})[0] == [1, 3, 7, 11]
    assert run(False, {6: "short", 10: "full"})[0] == [1, 5, 6, 10]
    assert run(True, {3: "arrival", 6: "short"})[0] == [1, 5, 9]
    _, rolling = run(False, {})  # last fork at call 9: request 7 preempted at step 11
    assert rolling.chosen == {7}
    assert [rolling.steps_until(7, n) for n in (9, 10, 11)] == [2, 1, None]
    assert rolling.steps_until(8, 9) is None
