"""The learned output-length model (preempt.engine.lengths) and the projection it informs:
the life table recovers a known hazard, a cap censors, cells shrink to the pool, files
round-trip and refuse corruption, and the learned projection keeps a subset of the plain
projection's picks, all of them when the model expects no early end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from preempt.core.config import ConfigError
from preempt.early.early_save import ProjectionPolicy
from preempt.early.projection import Projection
from preempt.engine.engine import Engine
from preempt.engine.lengths import PRIOR_REQUESTS, LengthModel, _position_bin
from tests.conftest import small_config
from tests.early.test_lookahead import _config, _loose_workload, _trace


def _geometric(p: float, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).geometric(p, size=n)


def test_the_life_table_recovers_a_constant_hazard():
    """Geometric lengths end at each token with probability p: the hazard, wherever many
    requests are still running."""
    p = 0.02
    lengths = _geometric(p, 20_000)
    model = LengthModel.fit(np.full(len(lengths), 100), np.full(len(lengths), 10**6), lengths)
    for n in (0, 5, 20, 60, 120):
        assert model.hazard(100, 10**6, n) == pytest.approx(p, rel=0.15), n


def test_an_output_stopped_by_its_cap_is_censored_and_the_cap_is_certain():
    lengths = np.full(500, 64)
    model = LengthModel.fit(np.full(500, 10), lengths, lengths)  # every output hit its max_tokens
    assert model.hazard(10, 64, 10) == 0.0  # no natural end was ever seen
    assert model.hazard(10, 64, 63) == 1.0  # the 64th token is the last, by the cap
    # half stop at 32 by themselves, half run into a 1024 cap: ends at 32 only
    mixed = LengthModel.fit(
        np.full(1000, 10), np.full(1000, 1024), np.r_[np.full(500, 32), np.full(500, 1024)]
    )
    assert mixed.hazard(10, 1024, 31) > 0.0 and mixed.hazard(10, 1024, 100) == 0.0


def test_cells_follow_their_own_lengths_and_thin_cells_the_pool():
    """Short prompts get short outputs, long prompts long ones: each rich cell reads as
    itself; a cell of 3 requests reads as the pool (PRIOR_REQUESTS average requests of pseudo-exposure)."""
    short, long = _geometric(0.1, 5000, 1), _geometric(0.01, 5000, 2)
    model = LengthModel.fit(
        np.r_[np.full(5000, 50), np.full(5000, 3000), np.full(3, 100_000)],
        np.full(10_003, 10**6),
        np.r_[short, long, [1, 1, 1]],
    )
    assert model.hazard(50, 10**6, 3) == pytest.approx(0.1, rel=0.2)
    assert model.hazard(3000, 10**6, 3) == pytest.approx(0.01, rel=0.3)
    thin, pooled = model.hazard(100_000, 10**6, 3), model.hazard(1, 10**6, 3)  # prompt 1: no cell
    assert thin == pytest.approx(pooled, rel=0.05) and PRIOR_REQUESTS > 3
    assert pooled == model.pooled[_position_bin(4)]  # no cell for prompt 1: the pool's table


def test_bad_fits_name_the_problem():
    with pytest.raises(ValueError, match="no finished requests"):
        LengthModel.fit([], [], [])
    with pytest.raises(ValueError, match="<= its max_tokens"):
        LengthModel.fit([10], [5], [6])
    with pytest.raises(ValueError, match="one entry per request"):
        LengthModel.fit([10, 11], [5], [5])


def test_a_model_round_trips_and_a_corrupt_file_is_refused(tmp_path):
    lengths = _geometric(0.05, 2000)
    model = LengthModel.fit(
        np.full(2000, 300), np.full(2000, 1024), np.minimum(lengths, 1024), [{"trace": "t"}]
    )
    path = tmp_path / "lengths.json"
    model.save(path)
    again = LengthModel.load(path)
    assert again.windows == [{"trace": "t"}] and again.num_requests == 2000
    assert [again.hazard(300, 1024, n) for n in range(40)] == [model.hazard(300, 1024, n) for n in range(40)]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the length model"):
        LengthModel.load(path)
    path.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="is not a length model"):
        LengthModel.load(path)


def test_fitting_on_a_trace_leaves_out_the_judged_window():
    workload = small_config(workload={"trace": "azure-code", "max_tokens_mode": "fixed"}).workload
    whole = LengthModel.from_trace(workload, 0, (math.inf, math.inf))
    held = LengthModel.from_trace(workload, 0, (600.0, 1200.0))
    assert 0 < held.num_requests < whole.num_requests
    assert [(w["start_s"], w["end_s"]) for w in held.windows][0] == (0.0, 600.0)
    assert held.windows[1]["start_s"] == 1200.0


def test_fitting_on_logged_runs_reads_their_finished_requests(tmp_path):
    """`preempt lengths RUN...`: the finished requests of runs' requests.parquet, and each
    run's window from its summary.json."""
    from preempt.cli import main as preempt

    for start in (0, 60):
        code = preempt(
            ["run", "--config", "preempt/configs/collect.yaml", "--out", str(tmp_path / f"run-{start}"),
             "--no-progress", "--set", f"workload.start_s={start}", "--set", "workload.duration_s=20"]
        )  # fmt: skip
        assert code == 0
    out = tmp_path / "lengths.json"
    assert preempt(["lengths", str(tmp_path / "run-0"), str(tmp_path / "run-60"), "--out", str(out)]) == 0
    model = LengthModel.load(out)
    assert model.num_requests > 50
    assert [(w["start_s"], w["end_s"]) for w in model.windows] == [(0.0, 20.0), (60.0, 80.0)]
    assert model.hazard(500, 1024, 50) > 0  # collect.yaml: a fixed 1024, outputs end by themselves
    assert preempt(["lengths", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


class _Running:
    """What `expected_ends` reads of a running request."""

    ids = iter(range(10**9))

    def __init__(self, num_output: int, max_tokens: int, prefilling: bool = False) -> None:
        self.request_id = next(self.ids)
        self.num_prompt_tokens = 100
        self.output_token_ids = [0] * num_output
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0 if prefilling else 100 + num_output - 1


def test_expected_ends_count_decoding_requests_until_their_cap():
    p = 0.02
    lengths = _geometric(p, 20_000)
    model = LengthModel.fit(np.full(20_000, 100), np.full(20_000, 10**6), lengths)
    h = model.hazard(100, 10**6, 10)
    one = model.expected_ends([_Running(10, 10**6)], 3)
    assert list(one) == pytest.approx([h, 2 * h, 3 * h], rel=0.01)
    assert list(model.expected_ends([_Running(10, 10**6, prefilling=True)], 3)) == [0.0, 0.0, 0.0]
    assert list(model.expected_ends([_Running(5000, 10**6)], 2)) == pytest.approx(
        [model.hazard(100, 10**6, 5000), model.hazard(100, 10**6, 5000) + model.hazard(100, 10**6, 5001)]
    )  # past the position lookup table
    capped = model.expected_ends([_Running(10, 12)], 4)  # its 12th token is its cap
    assert capped[0] == pytest.approx(h) and capped[1] == capped[2] == capped[3]
    many = [_Running(10, 10**6) for _ in range(50)]  # one end expected per step
    assert model.confident_steps(many, budget=-math.log(0.6), max_steps=10) == 1
    # 5 requests: 5h expected a token, so floor(budget / 5h) tokens, and the next schedule
    assert model.confident_steps(many[:5], budget=0.3, max_steps=10) == 1 + math.floor(0.3 / (5 * h))
    never = LengthModel.fit([100], [64], [64])
    assert never.confident_steps(many, budget=1e-9, max_steps=10) == 10


def test_the_learned_projection_keeps_a_subset_of_the_projections_picks(tmp_path):
    """On the same live state at every step: with the lengths of this workload (every
    output ends 40 tokens before its cap, naturally), the learned policy drops some of
    the plain projection's picks and adds none; with a model that saw no natural end, it
    keeps them all."""
    requests = _loose_workload()
    fitted = LengthModel.fit(
        [r.num_prompt_tokens for r in requests],
        [r.max_tokens for r in requests],
        [r.target_output_tokens for r in requests],
    )
    never = LengthModel.fit([10], [8], [8])
    plain = Projection(horizon_ms=20.0, horizon_steps=3)
    learned = ProjectionPolicy(20.0, 3, fitted, confidence=0.6)
    trusting = ProjectionPolicy(20.0, 3, never, confidence=0.6)
    counts = {"plain": 0, "learned": 0, "trusting": 0}

    def compare(engine) -> None:
        view = engine.view
        if not view.running:
            return
        want = plain.within(plain.forecast(view, 0.01))
        for name, policy in (("learned", learned), ("trusting", trusting)):
            policy._last_now = view.now - 0.01
            policy.prepare(view)
            assert policy.chosen <= want
            counts[name] += len(policy.chosen)
        assert trusting.chosen == want
        counts["plain"] += len(want)

    _trace(Engine(_config()), requests, hook=compare)
    assert counts["plain"] >= 10, counts
    assert counts["trusting"] == counts["plain"] and counts["learned"] < counts["plain"], counts


def test_a_length_model_is_for_the_projection_and_must_load(tmp_path):
    with pytest.raises(ConfigError, match="length_model informs the projection"):
        small_config(early_save={"policy": "rule", "length_model": "lengths.json"})
    from preempt.early.early_save import make_policy

    config = small_config(
        preemption={"mode": "swap"},
        early_save={"policy": "projection", "length_model": str(tmp_path / "none.json")},
    )
    with pytest.raises(ConfigError, match="early_save.length_model"):
        make_policy(config.early_save)
