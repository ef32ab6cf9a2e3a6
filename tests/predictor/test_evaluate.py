"""Metric definitions (predictor.evaluate) against hand-computed values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from predictor.evaluate import jsonable
from predictor.metrics import average_precision, best_f1_threshold, binary_metrics, event_recall, roc_auc


def test_auroc_and_auprc_hand_computed():
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    labels = np.array([0, 0, 1, 1])
    # Pairs (pos, neg): (0.35 > 0.1), (0.35 < 0.4), (0.8 > both): 3 of 4.
    assert roc_auc(scores, labels) == pytest.approx(0.75)
    # Ranked: 0.8 (P), 0.4 (N), 0.35 (P), 0.1 (N): AP = 0.5 * 1 + 0.5 * 2/3.
    assert average_precision(scores, labels) == pytest.approx(0.5 + 1 / 3)


def test_ties_count_half_and_group_together():
    labels = np.array([0, 1, 0, 1, 0])
    flat = np.full(5, 0.3)
    assert roc_auc(flat, labels) == pytest.approx(0.5)
    assert average_precision(flat, labels) == pytest.approx(0.4)  # one threshold: precision = rate
    assert math.isnan(roc_auc(flat, np.zeros(5)))
    assert math.isnan(average_precision(flat, np.zeros(5)))


def test_perfect_and_inverted_scores():
    labels = np.array([0, 0, 1, 1, 0, 1])
    assert roc_auc(labels.astype(float), labels) == 1.0
    assert average_precision(labels.astype(float), labels) == 1.0
    assert roc_auc(-labels.astype(float), labels) == 0.0


def test_threshold_maximises_f1():
    scores = np.array([0.9, 0.8, 0.7, 0.2, 0.1])
    labels = np.array([1, 1, 0, 1, 0])
    # >= 0.8: P=1, R=2/3, F1=0.8; >= 0.2: P=3/4, R=1, F1=6/7 (best); >= 0.1: F1=0.75.
    assert best_f1_threshold(scores, labels) == pytest.approx(0.2)
    assert best_f1_threshold(scores, np.zeros(5)) == math.inf


def test_binary_metrics_and_event_recall():
    scores = np.array([0.9, 0.1, 0.8, 0.7, 0.2, 0.6])
    labels = np.array([1, 1, 1, 0, 0, 1])
    time_to = np.array([0.03, 0.0, 0.02, math.inf, math.inf, 0.0])
    # Events: rows 0-1 are one event of request 7 at 1.03 s; row 2 one of request 8; row 5 one
    # of request 9.
    event_key = np.array([[7, 1_030_000], [7, 1_030_000], [8, 2_000_000], [0, -1], [0, -1], [9, 5]])
    m = binary_metrics(scores, labels, time_to, 0.65, event_key)
    assert (m["precision"], m["recall"], m["f1"]) == pytest.approx((2 / 3, 0.5, 4 / 7))
    assert m["mean_lead_time_s"] == pytest.approx(0.025)  # true positives: rows 0 and 2
    assert m["num_rows"] == 6 and m["num_positive"] == 4 and m["num_predicted"] == 3
    assert m["event_recall"] == pytest.approx(2 / 3)  # events 7 and 8 warned, 9 missed
    assert m["event_recall_ahead"] == pytest.approx(2 / 3)
    assert math.isnan(event_recall(np.zeros(6, bool), np.zeros(6, bool), event_key))  # no events


def test_jsonable_writes_nan_and_inf_as_null():
    out = jsonable({"a": math.nan, "b": {"c": math.inf, "d": 1.5}, "e": 3})
    assert json.loads(json.dumps(out)) == {"a": None, "b": {"c": None, "d": 1.5}, "e": 3}


def test_expected_value_threshold_weighs_stall_avoided_against_bytes_wasted():
    from predictor.data import FeatureTable
    from predictor.evaluate import best_expected_value_threshold, evaluate_scores, expected_value_curve

    # Request 0 is preempted at t = 1.0 (rows at 0.90 and 0.95); request 1 never is.
    n = 4
    table = FeatureTable(
        features=np.zeros((n, 8), np.float32),
        label=np.array([1, 1, 0, 0]),
        time_to_preemption_s=np.array([0.10, 0.05, np.inf, np.inf]),
        group=np.array([0, 0, 1, 1]),
        seed=np.zeros(n, np.int64),
        step=np.array([1, 2, 1, 2]),
        t_s=np.array([0.90, 0.95, 0.90, 0.95]),
        meta={},
        num_tokens=np.array([1000, 1000, 4000, 4000]),
        source=np.zeros(n, np.int64),
        kv_bytes_per_token=np.full(n, 1e6),
        copy_bytes_per_s=np.full(n, 1e10),  # 1000 tokens: 0.1 s of copy
        block_size=np.full(n, 16),
    )
    rows = np.arange(n)
    scores = np.array([0.9, 0.8, 0.3, 0.2])
    curve = expected_value_curve(table, rows, scores, num_points=20)
    by_threshold = {round(p["threshold"], 6): p for p in curve}
    high = by_threshold[round(float(np.quantile(scores, 1.0)), 6)]  # warns once, 0.1 s ahead
    assert high["stall_avoided_s"] == pytest.approx(min(992e6 / 1e10, 0.10))
    assert high["wasted_copy_s"] == 0.0 and high["precision"] == 1.0
    low = min(curve, key=lambda p: p["threshold"])  # warns request 1 too: 4 GB in vain
    assert low["wasted_gb"] == pytest.approx(4000 * 1e6 / 1e9) and low["expected_value_s"] < 0
    threshold = best_expected_value_threshold(curve)
    assert 0.3 < threshold <= 0.9
    metrics = evaluate_scores(table, rows, rows, scores, scores, rule="expected_value")
    assert metrics["threshold_curve"] == expected_value_curve(table, rows, scores)
    assert 0.3 < metrics["threshold"] <= 0.9
    assert metrics["precision"] == 1.0 and metrics["recall"] > 0


def test_waste_capped_threshold_on_a_hand_made_curve():
    from predictor.evaluate import best_waste_capped_threshold

    def point(threshold, avoided, share):
        return {"threshold": threshold, "stall_avoided_s": avoided, "waste_share": share}

    curve = [point(0.3, 0.06, 0.25), point(0.5, 0.05, 0.4), point(0.7, 0.03, 0.2), point(0.9, 0.01, 0.0)]
    # Walking down from 0.9: 0.7 is the last within 30%; 0.5 is over, so 0.3 (back under
    # the cap by chance) is never reached.
    assert best_waste_capped_threshold(curve, 0.3) == 0.7
    assert best_waste_capped_threshold(curve, 0.5) == 0.3
    assert best_waste_capped_threshold(curve, 0.1) == 0.9
    # Ties go to the stricter threshold; nothing avoided: never warn.
    assert best_waste_capped_threshold([point(0.4, 0.02, 0.0), point(0.8, 0.02, 0.0)], 0.3) == 0.8
    assert best_waste_capped_threshold([point(0.5, 0.0, 0.0)], 0.3) == math.inf


def test_waste_capped_walk_ends_only_where_the_waste_is_over_the_cap_beyond_doubt():
    from predictor.evaluate import best_waste_capped_threshold, wilson_lower

    def point(threshold, avoided, share, epochs):
        return {
            "threshold": threshold,
            "stall_avoided_s": avoided,
            "waste_share": share,
            "warned_epochs": epochs,
        }

    # The default collect's val curve (docs/archive/predictor-history.md): 0.308 wasted over 30 epochs is
    # within noise of a 0.30 cap, so it is skipped (not picked) and the walk goes on to
    # 0.88; 0.44 over 58 epochs is over it beyond doubt and ends the walk before the dip.
    curve = [
        point(0.98, 0.007, 0.0, 16),
        point(0.95, 0.015, 0.308, 30),
        point(0.88, 0.030, 0.278, 44),
        point(0.64, 0.036, 0.440, 58),
        point(0.30, 0.040, 0.250, 90),
    ]
    assert wilson_lower(0.308, 30) < 0.3 < wilson_lower(0.44, 58)
    assert best_waste_capped_threshold(curve, 0.3) == 0.88
    # Many epochs make the same share certain: the walk ends at 0.95, 0.98 is chosen.
    curve[1] = point(0.95, 0.015, 0.45, 3000)
    assert best_waste_capped_threshold(curve, 0.3) == 0.98
    # A handful of epochs, all wasted, is over any cap but 1 beyond doubt only with more.
    assert wilson_lower(1.0, 2) < 0.5 < wilson_lower(1.0, 10)
    assert wilson_lower(0.0, 0) == 0.0 and wilson_lower(0.2, math.inf) == pytest.approx(0.2)


def test_waste_capped_warns_where_the_expected_value_charges_waste_as_stall():
    from predictor.data import FeatureTable
    from predictor.evaluate import best_expected_value_threshold, evaluate_scores, expected_value_curve

    # Request 0: preempted at 1.0 (rows 0.90, 0.95; 0.1 s of copy, warned 0.1 s ahead).
    # Request 1: finishes, 4000 tokens (0.4 s of copy in vain) at scores 0.3 / 0.2.
    # Request 3: preempted 0.02 s after its row (score 0.6): avoids 0.02 s.
    # At score 0.5, request 4 (preempted 0.03 s after) avoids 0.03 s, and request 2
    # (finishes, 500 tokens: 0.0496 s of copy) is warned in vain.
    table = FeatureTable(
        features=np.zeros((7, 8), np.float32),
        label=np.array([1, 1, 0, 0, 1, 0, 1]),
        time_to_preemption_s=np.array([0.10, 0.05, np.inf, np.inf, 0.02, np.inf, 0.03]),
        group=np.array([0, 0, 1, 1, 3, 2, 4]),
        seed=np.zeros(7, np.int64),
        step=np.array([1, 2, 1, 2, 1, 1, 1]),
        t_s=np.array([0.90, 0.95, 0.90, 0.95, 0.98, 0.95, 0.97]),
        meta={},
        num_tokens=np.array([1000, 1000, 4000, 4000, 1000, 500, 1000]),
        source=np.zeros(7, np.int64),
        kv_bytes_per_token=np.full(7, 1e6),
        copy_bytes_per_s=np.full(7, 1e10),
        block_size=np.full(7, 16),
    )
    rows = np.arange(7)
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.6, 0.5, 0.5])
    curve = expected_value_curve(table, rows, scores, num_points=30)
    at_half = min((p for p in curve if 0.3 < p["threshold"] <= 0.5), key=lambda p: -p["threshold"])
    assert at_half["stall_avoided_s"] == pytest.approx(0.0992 + 0.02 + 0.03)
    assert at_half["wasted_copy_s"] == pytest.approx(0.0496)
    assert at_half["waste_share"] == pytest.approx(0.496 / (3 * 0.992 + 0.496))
    low = min(curve, key=lambda p: p["threshold"])
    assert low["waste_share"] == pytest.approx((4.0 + 0.496) / (4.0 + 0.496 + 3 * 0.992))
    # Expected value: request 2's copy time outweighs request 4's 0.03 s: stops at 0.6.
    assert 0.5 < best_expected_value_threshold(curve) <= 0.6
    # Waste capped at 30%: 14% wasted at 0.5 is allowed, 60% at 0.3 is not.
    metrics = evaluate_scores(table, rows, rows, scores, scores, rule="waste_capped", max_waste_share=0.3)
    assert 0.3 < metrics["threshold"] <= 0.5
    assert metrics["recall"] == 1.0 and metrics["max_waste_share"] == 0.3
    # At a 10% cap request 2's bytes are too many: back to 0.6.
    strict = evaluate_scores(table, rows, rows, scores, scores, rule="waste_capped", max_waste_share=0.1)
    assert 0.5 < strict["threshold"] <= 0.6


def test_per_source_keys_stay_apart_when_datasets_share_a_trace():
    from predictor.evaluate import source_names

    assert source_names(["azure-conv", "azure-code"]) == ["azure-conv", "azure-code"]
    assert source_names(["azure-conv", "azure-conv", "azure-code"]) == [
        "azure-conv#1",
        "azure-conv#2",
        "azure-code",
    ]
