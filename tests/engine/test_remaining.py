"""The remaining-output estimators (`preemption.remaining`, preempt.engine.remaining) and
the length model's expected output left (preempt.engine.lengths)."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.config import ConfigError, build_config
from preempt.engine.engine import Engine
from preempt.engine.lengths import LengthModel
from preempt.engine.priority import output_left, priority_scores, remaining_ktokens
from preempt.engine.remaining import LearnedRemaining, OracleRemaining, make_estimator
from tests.conftest import make_request


def _model(outputs, cap=1024, prompt=100):
    outputs = np.asarray(outputs)
    return LengthModel.fit([prompt] * len(outputs), [cap] * len(outputs), outputs)


def test_expected_output_left_of_a_constant_length_is_exact():
    model = _model([50] * 200, cap=1024)
    # Every output ends at token 50: from n tokens, 50 - n are left.
    assert model.expected_output_left(100, 1024, 0) == pytest.approx(50, rel=0.02)
    assert model.expected_output_left(100, 1024, 30) == pytest.approx(20, rel=0.05)


def test_expected_output_left_is_the_mean_of_a_geometric_length():
    rng = np.random.default_rng(0)
    outputs = np.minimum(rng.geometric(1 / 200, size=20000), 1024)
    model = _model(outputs, cap=1024)
    truth = float(np.mean(outputs))
    assert model.expected_output_left(100, 1024, 0) == pytest.approx(truth, rel=0.05)
    # Memoryless: far from the cap, what is left does not depend on what was made.
    assert model.expected_output_left(100, 1024, 100) == pytest.approx(
        model.expected_output_left(100, 1024, 0), rel=0.1
    )


def test_expected_output_left_respects_the_cap():
    model = _model([500] * 100, cap=1024)
    assert model.expected_output_left(100, 64, 0) <= 64
    assert model.expected_output_left(100, 64, 63) == pytest.approx(1.0)
    assert model.expected_output_left(100, 64, 64) == 0.0
    assert model.expected_output_left(100, 1024, 10) >= 1.0


def test_max_tokens_is_the_default_and_sets_nothing():
    config = build_config({"model": {"backend": "null"}})
    assert config.preemption.remaining == "max_tokens" and make_estimator(config) is None
    request = make_request(0, 100, 300)
    request.output_token_ids.extend([1] * 20)
    assert output_left(request) == 280 and remaining_ktokens(request) == pytest.approx((100 + 280) / 1000)


def test_oracle_reads_the_true_length_under_a_loose_cap():
    request = make_request(0, 100, 300)
    request.max_tokens = 1024
    request.output_token_ids.extend([1] * 20)
    OracleRemaining().update(request)
    assert request.expected_output_left == 280
    assert output_left(request) == 280


def test_the_vectorised_scores_read_the_estimate_too():
    weights = build_config({}).preemption.priority_weights
    requests = [make_request(i, 100, 500) for i in range(3)]
    for r in requests:
        r.max_tokens = 1024
    requests[1].expected_output_left = 10.0
    scores = priority_scores(requests, 1.0, weights)
    assert scores[1] > scores[0] == scores[2]


def test_learned_is_fitted_outside_the_replayed_window():
    config = build_config(
        {
            "model": {"backend": "null"},
            "workload": {"trace": "azure-conv", "start_s": 600, "duration_s": 60, "max_tokens_mode": "fixed"},
            "preemption": {"remaining": "learned"},
        }
    )
    estimator = make_estimator(config)
    assert isinstance(estimator, LearnedRemaining)
    windows = estimator.model.windows
    assert windows[0] == {"trace": "azure-conv", "start_s": 0.0, "end_s": 600}
    assert windows[1]["start_s"] == 660


def test_a_bad_length_model_file_is_a_config_error(tmp_path):
    bad = tmp_path / "lengths.json"
    bad.write_text("{}")
    config = build_config(
        {"model": {"backend": "null"}, "preemption": {"remaining": "learned", "length_model": str(bad)}}
    )
    with pytest.raises(ConfigError, match="preemption.length_model"):
        make_estimator(config)


def test_the_engine_re_estimates_after_every_token():
    config = build_config(
        {
            "model": {"backend": "null"},
            "cache": {"block_size": 16, "num_blocks": 256},
            "scheduler": {"policy": "priority_score"},
            "preemption": {"remaining": "oracle"},
        }
    )
    engine = Engine(config)
    request = make_request(0, 32, 40)
    request.max_tokens = 512
    engine.add_request(request)
    assert request.expected_output_left == 40
    seen = []
    while request.finish_s is None:
        engine.step()
        seen.append(request.expected_output_left)
    assert seen[-2] == 1 and len(request.output_token_ids) == 40
    assert all(a >= b for a, b in zip(seen, seen[1:], strict=False))
