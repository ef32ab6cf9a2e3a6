"""Online stateful inference (preempt.early.online_predictor): parity with the offline model, state
semantics, checkpoint loading and its errors. One module fixture trains a tiny checkpoint."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from predictor.data import PreemptionDataModule, SplitConfig, load_table
from predictor.model import PreemptionLSTM
from predictor.train import TrainConfig, train
from preempt.early.online_predictor import OnlinePredictor, PredictorCheckpointError
from tests.predictor import synthetic_dataset

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "features", num_requests=90)


@pytest.fixture(scope="module")
def trained(data_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    config = TrainConfig(max_epochs=2, batch_size=256, seq_len=4, wandb="disabled", progress=False)
    metrics = train(data_path, out, config)
    return out / "predictor.ckpt", metrics


@pytest.fixture(scope="module")
def offline(trained):
    model = PreemptionLSTM.load_from_checkpoint(trained[0], map_location="cpu", weights_only=True)
    return model.eval()


def _histories(data_path, lengths):
    """Real feature histories of a few requests (step order), cut to `lengths`."""
    table = load_table(data_path)
    out = []
    for group, length in zip(np.unique(table.group)[: len(lengths)], lengths, strict=True):
        rows = np.flatnonzero(table.group == group)
        rows = rows[np.argsort(table.step[rows])]
        out.append(np.resize(table.features[rows], (length, 8)))  # repeats when too short
    return out


def test_online_steps_equal_the_offline_model_on_each_history(trained, offline, data_path):
    # Requests of different lengths join at different steps, one pauses for a few steps
    # (preempted: no rows, state kept), ids come in a shuffled order every step, and each
    # is forgotten when it ends (its slot is then reused by a later one).
    lengths = [1, 7, 23, 40, 12, 30]
    joins = [0, 0, 3, 5, 9, 20]
    histories = _histories(data_path, lengths)
    ids = [101, 7, 55, 3, 900, 42]
    paused = {3: range(10, 14)}  # request 3 logs no row at engine steps 10-13
    predictor = OnlinePredictor.from_checkpoint(trained[0], capacity=2)  # forces growth too
    got = {rid: [] for rid in ids}
    position = dict.fromkeys(ids, 0)
    rng = np.random.default_rng(0)
    for engine_step in range(80):
        active = [
            i
            for i, rid in enumerate(ids)
            if joins[i] <= engine_step
            and position[rid] < lengths[i]
            and engine_step not in paused.get(rid, ())
        ]
        rng.shuffle(active)
        if active:
            features = np.stack([histories[i][position[ids[i]]] for i in active])
            probs = predictor.step([ids[i] for i in active], features)
            assert probs.dtype == np.float32 and probs.shape == (len(active),)
            for i, p in zip(active, probs, strict=True):
                got[ids[i]].append(p)
                position[ids[i]] += 1
        predictor.forget([ids[i] for i in active if position[ids[i]] == lengths[i]])
    assert predictor.num_tracked == 0
    for i, rid in enumerate(ids):
        with torch.no_grad():
            expected = offline.step_probs(torch.from_numpy(histories[i])[None])[0].numpy()
        np.testing.assert_allclose(np.array(got[rid]), expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(predictor.history_probs(histories[i][None])[0], expected, atol=1e-6)


def test_replaying_a_split_online_gives_the_evaluated_probabilities(trained, offline, data_path):
    # The rows `preempt eval-predictor` scores, replayed as the engine would: one batched
    # step per logged step with every request running at it, forget after a request's
    # last row. The online probabilities are the evaluated ones, row for row.
    hp = offline.hparams
    datamodule = PreemptionDataModule(
        data_path, split=SplitConfig(hp.split_seed, hp.val_fraction, hp.test_fraction)
    )
    datamodule.setup()
    table, rows = datamodule.table, datamodule.rows["val"]
    expected = offline.predict_rows(datamodule.loader("val"), rows)
    last_step = {}
    for row in rows:
        last_step[table.group[row]] = max(last_step.get(table.group[row], -1), table.step[row])
    predictor = OnlinePredictor.from_checkpoint(trained[0])
    got = np.full(len(rows), np.nan, dtype=np.float32)
    order = np.argsort(table.step[rows], kind="stable")
    steps = table.step[rows][order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    for lo, hi in zip(starts, np.r_[starts[1:], len(steps)], strict=True):
        batch = order[lo:hi]  # positions in `rows` of one logged step
        groups = table.group[rows[batch]]
        got[batch] = predictor.step(groups.tolist(), table.features[rows[batch]])
        predictor.forget([g for g in groups.tolist() if last_step[g] == steps[lo]])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert predictor.num_tracked == 0


def test_forget_and_reset_restart_from_the_zero_state(trained):
    x = np.random.default_rng(1).random((4, 8), dtype=np.float32)
    fresh = OnlinePredictor.from_checkpoint(trained[0]).step([1, 2, 3, 4], x)
    predictor = OnlinePredictor.from_checkpoint(trained[0], capacity=4)
    predictor.step([1, 2, 3, 4], x)
    second = predictor.step([1, 2, 3, 4], x)
    assert not np.allclose(second, fresh, atol=1e-6)  # the state carried forward
    predictor.forget([2, 99])  # unknown ids are ignored
    assert predictor.num_tracked == 3 and 2 not in predictor and 1 in predictor
    again = predictor.step([4, 2, 1], x[[3, 1, 0]])
    assert again[1] == pytest.approx(fresh[1], abs=1e-6)  # 2 starts over
    assert not np.isclose(again[0], fresh[3], atol=1e-6)  # 4 and 1 kept their history
    predictor.reset()
    assert predictor.num_tracked == 0
    np.testing.assert_allclose(predictor.step([1, 2, 3, 4], x), fresh, atol=1e-6)
    # Churn within capacity reuses slots instead of growing.
    for rid in range(100, 120):
        predictor.forget([1, 2, 3, 4, rid - 1])
        predictor.step([rid], x[:1])
    assert predictor.capacity == 4
    assert predictor.step([], np.zeros((0, 8), np.float32)).shape == (0,)


def test_step_rejects_bad_input(trained):
    predictor = OnlinePredictor.from_checkpoint(trained[0])
    with pytest.raises(ValueError, match="twice"):
        predictor.step([5, 5], np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"\(3, 8\)"):
        predictor.step([1, 2, 3], np.zeros((3, 7), np.float32))


def test_threshold_comes_from_the_checkpoint_unless_overridden(trained):
    path, metrics = trained
    assert OnlinePredictor.from_checkpoint(path).threshold == pytest.approx(metrics["threshold"])
    assert OnlinePredictor.from_checkpoint(path, threshold=0.3).threshold == 0.3
    with pytest.raises(ValueError, match="threshold"):
        OnlinePredictor.from_checkpoint(path, threshold=1.5)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["history"] == "full"


def test_loading_never_imports_lightning(trained):
    code = (
        "import sys, numpy as np\n"
        "from preempt.early.online_predictor import OnlinePredictor\n"
        f"p = OnlinePredictor.from_checkpoint({str(trained[0])!r})\n"
        "assert p.step([1], np.zeros((1, 8), np.float32)).shape == (1,)\n"
        "assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_corrupt_and_foreign_checkpoints_fail_clearly(trained, tmp_path):
    path = trained[0]
    with pytest.raises(PredictorCheckpointError, match="not found.*preempt train"):
        OnlinePredictor.from_checkpoint(tmp_path / "none.ckpt")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(PredictorCheckpointError, match="cannot read predictor checkpoint"):
        OnlinePredictor.from_checkpoint(truncated)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(PredictorCheckpointError, match="cannot read"):
        OnlinePredictor.from_checkpoint(junk)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(PredictorCheckpointError, match="no state_dict"):
        OnlinePredictor.from_checkpoint(foreign)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint["state_dict"]["lstm.weight_hh_l0"] = torch.zeros(128, 32)
    wrong = tmp_path / "wrong.ckpt"
    torch.save(checkpoint, wrong)
    with pytest.raises(PredictorCheckpointError, match="lstm.weight_hh_l0.*shape"):
        OnlinePredictor.from_checkpoint(wrong)


def test_window_trained_checkpoints_warn_about_the_skew(trained, tmp_path):
    checkpoint = torch.load(trained[0], map_location="cpu", weights_only=True)
    del checkpoint["hyper_parameters"]["history"]  # as written before whole-history training
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.warns(UserWarning, match="zero-started windows"):
        OnlinePredictor.from_checkpoint(old)


def test_bench_predictor_quick_reports_the_step_ratio():
    from preempt.bench.predictor import bench_predictor

    threads = torch.get_num_threads()
    result = bench_predictor(quick=True)
    assert torch.get_num_threads() == threads  # restored
    assert result["num_running"] == 256 and result["null_engine_step_us_median"] > 0
    ratio = result["predictor_step_us_median"] / result["null_engine_step_us_median"]
    assert result["predictor_fraction_of_step"] == pytest.approx(ratio, abs=1e-4)
    assert result["meets_target"] == (ratio <= result["target_fraction"])
    # the cheap forecast, against the null step and the step the clock models at this batch
    assert result["projection_us_median"] > 0 and result["modelled_step_us_median"] > 0
    modelled = result["projection_us_median"] / result["modelled_step_us_median"]
    assert result["projection_fraction_of_modelled_step"] == pytest.approx(modelled, abs=1e-4)


def test_a_checkpoint_for_another_horizon_feature_set_or_stride_is_refused_online(trained, tmp_path):
    from preempt.core.config import ConfigError, EarlySaveConfig
    from preempt.early.early_save import make_policy
    from preempt.early.features import SCALE_FREE_NAMES

    path = str(trained[0])
    policy = make_policy(EarlySaveConfig(policy="lstm", checkpoint=path))
    assert policy.features.feature_set == "v1"  # as trained
    trained_for = "trained for horizon_ms=50, horizon_steps=0, feature_set=v1, every_k_steps=1"
    for wrong in (
        {"horizon_ms": 100.0},
        {"horizon_steps": 4},
        {"feature_set": "scale_free"},
        {"every_k_steps": 4},
    ):
        with pytest.raises(ConfigError, match=trained_for):
            make_policy(EarlySaveConfig(policy="lstm", checkpoint=path, **wrong))
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    hparams.update(
        horizon_steps=4, feature_set="scale_free", feature_names=list(SCALE_FREE_NAMES), every_k_steps=8
    )
    other = tmp_path / "scale_free.ckpt"
    torch.save(checkpoint, other)
    with pytest.raises(
        ConfigError, match="feature_set=scale_free, every_k_steps=8, but the engine asks for .*feature_set=v1"
    ):
        make_policy(EarlySaveConfig(policy="lstm", checkpoint=str(other)))
    with pytest.raises(ConfigError, match="every_k_steps=8, but the engine asks for .*every_k_steps=1"):
        make_policy(
            EarlySaveConfig(policy="lstm", checkpoint=str(other), horizon_steps=4, feature_set="scale_free")
        )
    policy = make_policy(
        EarlySaveConfig(
            policy="lstm", checkpoint=str(other), horizon_steps=4, feature_set="scale_free", every_k_steps=8
        )
    )
    assert policy.features.feature_set == "scale_free" and policy.every_k_steps == 8
    # The same set name with other columns (scale_free before `headroom`): refused by name.
    old_names = [*SCALE_FREE_NAMES[:-1], "free_kv_fraction"]
    hparams.update(feature_names=old_names, every_k_steps=1)
    stale = tmp_path / "stale.ckpt"
    torch.save(checkpoint, stale)
    with pytest.raises(
        ConfigError, match="trained on the features .*free_kv_fraction.* now computes .*headroom"
    ):
        make_policy(
            EarlySaveConfig(policy="lstm", checkpoint=str(stale), horizon_steps=4, feature_set="scale_free")
        )


def test_a_waste_cap_moves_the_online_threshold_and_changes_no_output(trained, tmp_path):
    # The trained checkpoint drives early saves in a small preempting run (at threshold
    # 0.05 most requests are warned and most copies are wasted: recent share ~0.8). With
    # the cap under that share the threshold ends above where it started, with a cap over
    # it below. Lossless: every output equals the run without early saves, and every early
    # byte is accounted for.
    from predictor.train import _store_threshold
    from preempt.core.config import ConfigError, EarlySaveConfig
    from preempt.early.early_save import WasteCap, make_policy
    from tests.kv.test_preemption import _digests, _run

    _, plain = _run("swap_zstd")
    for cap, moves_up in ((0.2, True), (0.99, False)):
        early = {"policy": "lstm", "checkpoint": str(trained[0]), "threshold": 0.05, "waste_cap": cap}
        engine, requests = _run("swap_zstd", early=early)
        assert _digests(requests) == _digests(plain)
        early_copies, policy = engine.saver.early, engine.early_saver.policy
        assert early_copies.early_bytes_used + early_copies.early_bytes_wasted == early_copies.early_bytes_raw
        assert isinstance(policy.waste_cap, WasteCap)
        share = policy.waste_cap.recent_waste_share
        assert share is not None and 0.2 < share < 0.99  # it saw outcomes, between the caps
        assert (policy.threshold > 0.05) == moves_up
    # A checkpoint that never warns (threshold inf) gives the controller nowhere to start.
    never = tmp_path / "never.ckpt"
    never.write_bytes(trained[0].read_bytes())
    _store_threshold(never, float("inf"), "waste_capped")
    with pytest.raises(ConfigError, match="early_save.waste_cap.*never warns.*early_save.threshold"):
        make_policy(EarlySaveConfig(policy="lstm", checkpoint=str(never), waste_cap=0.3))


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_forecast_set_online_is_the_set_it_was_trained_on(tmp_path, prefetch):
    """Train/serve consistency for the stateful `forecast` set: the features the `lstm`
    policy computes online (its own fork, its own news) equal the rows the feature
    logger wrote for the same run, step for step (a threshold no p reaches keeps the
    live timeline the logged one's). With restore prefetch too: the prefetcher runs
    before the early saver, so the policy reads the state the logger reads after the step."""
    from preempt.core.config import EngineConfig
    from preempt.engine.engine import Engine
    from preempt.obs.dataset import FeatureConfig, FeatureLogger, save_dataset
    from tests.early.test_lookahead import _config, _loose_workload

    horizon = {"horizon_ms": 15.0, "horizon_steps": 3}
    base = _config("null").model_dump()
    if prefetch:
        base["preemption"] |= {"mode": "swap", "async_restore": True}
        base["early_save"] |= {"prefetch": True}
    engine = Engine(EngineConfig.model_validate(base))
    logger = FeatureLogger(FeatureConfig(feature_set="forecast", **horizon))
    engine.run(_loose_workload(), on_step=lambda output: logger(engine.view, output))
    columns = logger.columns(engine.scheduler.records)
    info = {"trace": "test", "seed": 0, **logger.config.meta()}
    save_dataset(columns, info, tmp_path / "features")
    config = TrainConfig(
        max_epochs=1, batch_size=256, seq_len=8, wandb="disabled", progress=False, threshold_rule="f1"
    )
    train(tmp_path / "features", tmp_path / "train", config)

    early = {"policy": "lstm", "checkpoint": str(tmp_path / "train" / "predictor.ckpt")}
    early |= {"feature_set": "forecast", "threshold": 1 - 1e-12, **horizon}
    engine = Engine(EngineConfig.model_validate(base | {"early_save": base["early_save"] | early}))
    policy = engine.early_saver.policy
    online = []
    select = policy.select

    def watching(running, features, now):
        online.append(([r.request_id for r in running], features.copy()))
        return select(running, features, now)

    policy.select = watching
    engine.run(_loose_workload())
    assert engine.saver.early.num_early_saves == 0
    ids = np.concatenate([np.asarray(i) for i, _ in online])
    features = np.concatenate([f for _, f in online])
    np.testing.assert_array_equal(ids, columns["request_id"])
    np.testing.assert_array_equal(features, columns["features"])
    lead = columns["features"][:, 4]
    assert np.count_nonzero(lead) >= 10
    # The same forks, so the same news (here every finish is early: max_tokens is loose).
    forks = policy.features.rolling.lookahead.num_forks
    assert forks == logger.source.rolling.lookahead.num_forks and forks > 10
    assert engine.stats()["lookahead_forks"] == forks  # the policy's cost is counted
    if prefetch:
        assert engine.stats()["num_prefetch_admitted"] > 0  # the prefetcher did act
