"""Feature logging and labels (preempt.early.features, preempt.obs.dataset) and `preempt collect`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from preempt.cli import main
from preempt.core.config import PreemptionConfig, build_config
from preempt.core.config_files import BUNDLED_CONFIGS
from preempt.early.features import FEATURE_DOCS, FEATURE_NAMES, compute_features
from preempt.engine.engine import Engine
from preempt.kv.record import PreemptionRecord
from preempt.obs.dataset import FeatureConfig, FeatureLogger, label_rows, save_dataset
from tests.conftest import make_request

COLLECT_CONFIG = BUNDLED_CONFIGS / "collect.yaml"


def _config():
    """Null backend, priority policy with a VIP mix and a pool small enough to preempt."""
    return build_config(
        {
            "model": {"backend": "null"},
            "cache": {"block_size": 16, "num_blocks": 96},
            "scheduler": {"policy": "priority_score", "max_num_seqs": 6, "max_num_batched_tokens": 512},
            "preemption": {"mode": "swap", "max_preemption_per_min": None},
        }
    )


def _requests(num: int = 40):
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(0.05, size=num))
    return [
        make_request(
            i,
            int(rng.integers(16, 300)),
            int(rng.integers(8, 200)),
            arrival_s=float(arrivals[i]),
            sla_level=int(rng.integers(0, 3)),
        )
        for i in range(num)
    ]


def _collect(requests, feature_config: FeatureConfig | None = None):
    engine = Engine(_config())
    logger = FeatureLogger(feature_config)
    engine.run(requests, on_step=lambda output: logger(engine.view, output))
    return logger.columns(engine.scheduler.records), engine


def test_names_docs_and_shape():
    assert len(FEATURE_NAMES) == 8 and len(set(FEATURE_NAMES)) == 8
    assert set(FEATURE_DOCS) == set(FEATURE_NAMES)
    running = [make_request(i, 100 + 50 * i, 64, arrival_s=0.0, sla_level=i % 2) for i in range(3)]
    waiting = [make_request(9, 10, 10, arrival_s=0.5, sla_level=2)]
    running[0].slice_used_s = 0.02
    running[1].num_preemptions = 2
    config = PreemptionConfig()
    features = compute_features(running, waiting, 1.0, 30, 120, config)
    assert features.shape == (3, 8) and features.dtype == np.float32
    col = {name: features[:, i] for i, name in enumerate(FEATURE_NAMES)}
    np.testing.assert_allclose(col["num_preemptions"], [0, 2, 0])
    np.testing.assert_allclose(col["seq_ktokens"], [0.1, 0.15, 0.2])
    np.testing.assert_allclose(col["slice_usage"], [2.0, 0.0, 0.0])  # 20 ms of a 10 ms short slice
    np.testing.assert_allclose(col["free_kv_fraction"], 0.25)
    np.testing.assert_allclose(col["sla_level"], [0, 1, 0])
    # Same age; the longer remaining work scores lower: request 2 (level 0, 264 tokens
    # left) is the lowest, request 1 (VIP) the highest.
    np.testing.assert_allclose(col["score_rank"], [1, 2, 0])
    # The fresh VIP challenger (score ~1.6) beats the level-0 requests (~1.1) by the margin
    # but not the VIP one.
    np.testing.assert_allclose(col["queue_pressure"], [1, 0, 1])


def test_features_never_read_the_true_output_length():
    running = [make_request(i, 100, 64, arrival_s=0.1 * i) for i in range(4)]
    before = compute_features(running, running[:1], 2.0, 10, 100, PreemptionConfig())
    for r in running:
        r.target_output_tokens = 1
    after = compute_features(running, running[:1], 2.0, 10, 100, PreemptionConfig())
    np.testing.assert_array_equal(before, after)


def test_no_future_leakage_when_the_trace_is_cut():
    """Features at a step do not change when the rest of the trace is cut away."""
    requests = _requests()
    full, _ = _collect(requests)
    assert full["label"].sum() > 0, "the test workload should preempt"
    cut_s = float(np.median([r.arrival_s for r in requests]))
    cut, _ = _collect([r for r in _requests() if r.arrival_s < cut_s])
    before_full = full["t_s"] < cut_s
    before_cut = cut["t_s"] < cut_s
    assert before_full.sum() == before_cut.sum() > 100
    for key in ("request_id", "step", "t_s", "features"):
        np.testing.assert_array_equal(full[key][before_full], cut[key][before_cut])


def test_every_k_steps_logs_a_subset():
    every, _ = _collect(_requests())
    third, _ = _collect(_requests(), FeatureConfig(every_k_steps=3))
    assert set(np.unique(third["step"]) % 3) == {0}
    keep = np.isin(every["step"], third["step"])
    np.testing.assert_array_equal(every["features"][keep], third["features"])
    np.testing.assert_array_equal(every["label"][keep], third["label"])  # labels use all records


def _record(time_s: float, request_id: int, action: str = "save", reason: str = "memory") -> PreemptionRecord:
    return PreemptionRecord(time_s, request_id, reason, action, num_tokens=10)


def test_labels_on_hand_made_records():
    request_ids = np.array([1, 1, 1, 1, 2, 2, 3])
    t_s = np.array([1.0, 1.02, 1.06, 2.0, 1.0, 1.0, 1.0])
    records = [
        _record(0.5, 1),  # in the past of every row: never a label
        _record(1.05, 1),  # exactly 50 ms after row 0: inside the (inclusive) horizon
        _record(1.5, 1, action="none"),  # failed attempt: the request kept running
        _record(1.0500001, 2, reason="priority"),  # just past the horizon of t = 1.0
        _record(1.01, 3, action="pause", reason="priority"),
        _record(1.02, 3, action="save", reason="reclaim"),  # deferred save of a paused one
    ]
    label, time_to, _ = label_rows(request_ids, t_s, records, horizon_s=0.05)
    np.testing.assert_array_equal(label, [1, 1, 0, 0, 0, 0, 1])
    np.testing.assert_allclose(time_to[:3], [0.05, 0.03, math.inf])
    assert time_to[3] == math.inf  # the only later record kept it running
    np.testing.assert_allclose(time_to[4:6], 0.0500001)
    np.testing.assert_allclose(time_to[6], 0.01)


def test_labels_match_the_engine_records():
    columns, engine = _collect(_requests())
    events = [r for r in engine.scheduler.records if r.action != "none" and r.reason != "reclaim"]
    assert events
    for row in np.flatnonzero(columns["label"])[:50]:
        rid, t = columns["request_id"][row], columns["t_s"][row]
        assert any(r.request_id == rid and t <= r.time_s <= t + 0.05 + 1e-9 for r in events)
    # A preemption is decided by the schedule() right after the request's last logged
    # step, at that row's t_s: its last row before the event has time_to exactly 0.
    for record in events:
        rows = np.flatnonzero(
            (columns["request_id"] == record.request_id) & (columns["t_s"] <= record.time_s)
        )
        assert len(rows) and columns["time_to_preemption_s"][rows[-1]] == 0.0


def test_saving_shows_datasets_bar_unless_asked_not_to(tmp_path, capsys):
    columns = {
        "request_id": np.array([0, 1], dtype=np.int64),
        "step": np.array([0, 1], dtype=np.int64),
        "t_s": np.array([0.0, 0.01]),
        "features": np.zeros((2, 8), dtype=np.float32),
        "label": np.array([0, 1], dtype=np.int64),
        "time_to_preemption_s": np.array([np.inf, 0.01]),
    }
    info = {"trace": "hand", "seed": 0, "horizon_ms": 50.0}
    save_dataset(columns, info, tmp_path / "quiet", progress=False)
    assert "Saving the dataset" not in capsys.readouterr().err
    save_dataset(columns, info, tmp_path / "loud")
    assert "Saving the dataset" in capsys.readouterr().err


def test_collect_writes_a_dataset(tmp_path, capsys):
    import datasets

    features_dir = tmp_path / "features"
    args = ["collect", "--config", str(COLLECT_CONFIG), "--out", str(tmp_path / "run")]
    args += ["--features", str(features_dir), "--duration", "40", "--no-progress"]
    assert main([*args, "--set", "features.horizon_ms=50"]) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out.split("\nwrote")[0])
    assert "Saving the dataset" not in printed.err  # --no-progress: datasets' own bar too
    assert (tmp_path / "run" / "requests.parquet").is_file() and (tmp_path / "run" / "summary.json").is_file()

    dataset = datasets.load_from_disk(str(features_dir))
    assert set(dataset.column_names) == {
        "request_id",
        "seed",
        "step",
        "t_s",
        "features",
        "label",
        "time_to_preemption_s",
        "steps_to_preemption",
        "num_tokens",
    }
    assert dataset.features["features"].length == 8
    assert dataset.features["features"].feature.dtype == "float32"
    assert len(dataset) == summary["num_rows"] > 0
    assert summary["num_preemptions"] > 0 and summary["num_positive"] > 0
    meta = json.loads(dataset.info.description)
    assert meta["feature_names"] == list(FEATURE_NAMES)
    assert meta["horizon_ms"] == 50 and meta["seed"] == 0 and meta["trace"] == "azure-conv"
    assert meta["config"]["scheduler"]["policy"] == "priority_score"
    table = dataset.with_format("numpy")[:]
    assert np.all(table["label"] == (table["time_to_preemption_s"] <= 0.05 + 1e-9))


def test_collect_rejects_bad_feature_keys(tmp_path, capsys):
    base = ["collect", "--out", str(tmp_path / "r"), "--features", str(tmp_path / "f"), "--no-progress"]
    assert main([*base, "--set", "features.every_k=2"]) == 2
    assert "features.every_k" in capsys.readouterr().err
    assert main([*base, "--set", "features.every_k_steps=0"]) == 2
    assert "every_k_steps" in capsys.readouterr().err
    with pytest.raises(ValueError):
        FeatureConfig(horizon_ms=0)


def test_vectorised_priority_scores_equal_the_scalar_score():

    from preempt.core.config import PriorityWeights
    from preempt.engine.priority import priority_score, priority_scores
    from tests.conftest import make_request

    requests = [make_request(i, 10 + i, 20, arrival_s=0.1 * i, sla_level=i % 3) for i in range(40)]
    for request in requests[:10]:
        request.num_computed_tokens, request.output_token_ids = 5, [1, 2, 3]
    weights = PriorityWeights(age=0.3, sla=0.8, tokens=0.5)
    expected = [priority_score(r, 7.0, weights) for r in requests]
    assert priority_scores(requests, 7.0, weights).tolist() == expected  # same float ops, bit-equal
    assert priority_scores([], 7.0, weights).shape == (0,)


@pytest.mark.parametrize("mode", ["pause", "swap", "recompute"])
def test_scheduler_waiting_scores_track_the_queue(mode):
    """The scheduler's cached waiting scores equal scoring the queue from scratch at every
    step, through admissions, preemptions, pauses and reclaims (paused requests whose KV
    is reclaimed while they wait)."""
    import numpy as np

    from preempt.engine.engine import Engine
    from preempt.engine.priority import priority_scores
    from tests.conftest import small_config
    from tests.kv.test_preemption import AGGRESSIVE, _workload

    config = small_config(
        cache={"num_blocks": 30},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": mode, **AGGRESSIVE},
        model={"backend": "null"},
    )
    engine = Engine(config)
    for request in _workload():
        engine.add_request(request)
    scheduler, weights = engine.scheduler, config.preemption.priority_weights
    steps = 0
    while scheduler.has_unfinished:
        engine.step()
        steps += 1
        now = engine.clock.now()
        fast = np.sort(scheduler.waiting_scores(now))
        slow = np.sort(priority_scores(scheduler.waiting_requests(), now, weights))
        np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-9)
    assert steps > 10 and engine.scheduler.num_preemptions > 0


def test_step_horizon_counts_engine_steps():
    records = [PreemptionRecord(1.0, 7, "memory", "save", 10)]
    ids = np.array([7, 7, 7, 7], dtype=np.int64)
    t_s = np.array([0.2, 0.6, 0.9, 1.0])
    step_ends = np.array([0.1, 0.2, 0.3, 0.6, 0.8, 0.9, 1.0, 1.5])
    label, time_to, steps_to = label_rows(ids, t_s, records, 0.05, horizon_steps=2, step_ends=step_ends)
    # 0.2 -> steps ending at 0.3, 0.6, 0.8, 0.9, 1.0 come first: the 6th schedule decides it
    assert steps_to.tolist() == [6, 4, 2, 1]
    assert label.tolist() == [0, 0, 1, 1]
    time_only, _, _ = label_rows(ids, t_s, records, 0.05, horizon_steps=0, step_ends=step_ends)
    assert time_only.tolist() == [0, 0, 0, 1]


def test_scale_free_features_do_not_move_with_the_scale():
    """Doubling every length, the pool and the queue's seats leaves the shares alone."""
    from preempt.core.config import PreemptionConfig
    from preempt.early.features import SCALE_FREE_NAMES, scale_free_features

    def batch(scale):
        running = []
        for i in range(4):
            r = make_request(i, 40 * scale, 8 * scale, sla_level=i % 2)
            r.num_computed_tokens = 40 * scale
            r.block_ids = list(range(i * 10 * scale, i * 10 * scale + 10 * scale))
            running.append(r)
        return running

    prefs = PreemptionConfig(priority_weights={"age": 0.0, "sla": 0.8, "tokens": 0.0})
    small = scale_free_features(batch(1), np.zeros(0), 0.0, 40, 100, 4, 8, prefs)
    large = scale_free_features(batch(2), np.zeros(0), 0.0, 80, 200, 4, 16, prefs)
    assert small.shape == (4, len(SCALE_FREE_NAMES))
    np.testing.assert_allclose(small, large, rtol=1e-6)
    assert small[0, SCALE_FREE_NAMES.index("pool_share")] == pytest.approx(0.1)
    assert small[0, SCALE_FREE_NAMES.index("need_share")] == pytest.approx(2 / 40)


def test_collect_scale_free_features_with_a_step_horizon(tmp_path, capsys):
    import datasets

    features_dir = tmp_path / "features"
    args = ["collect", "--config", str(COLLECT_CONFIG), "--out", str(tmp_path / "run")]
    args += ["--features", str(features_dir), "--duration", "40", "--no-progress"]
    sets = ["--set", "features.feature_set=scale_free", "--set", "features.horizon_steps=3"]
    assert main([*args, *sets]) == 0
    capsys.readouterr()
    dataset = datasets.load_from_disk(str(features_dir))
    meta = json.loads(dataset.info.description)
    assert meta["feature_set"] == "scale_free" and meta["horizon_steps"] == 3
    assert meta["feature_names"][1] == "pool_share"
    table = dataset.with_format("numpy")[:]
    expected = (table["time_to_preemption_s"] <= 0.05 + 1e-9) | (
        (table["steps_to_preemption"] >= 1) & (table["steps_to_preemption"] <= 3)
    )
    assert np.all(table["label"] == expected) and table["label"].sum() > 0
    assert np.all(table["features"][:, 1] <= 1.0) and np.all(table["num_tokens"] > 0)
