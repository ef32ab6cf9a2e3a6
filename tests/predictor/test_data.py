"""The split by request, the windows and the train-only statistics (predictor.data)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from predictor.baselines import rule_scores
from predictor.data import (
    LengthBatchSampler,
    PreemptionDataModule,
    SplitConfig,
    load_table,
    request_sequences,
    split_rows,
)
from tests.predictor import COL, synthetic_dataset

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("data") / "features")


def test_split_keeps_each_request_in_one_split(data_path):
    table = load_table(data_path)
    rows = split_rows(table.group, SplitConfig(seed=0))
    all_rows = np.concatenate([rows[name] for name in ("train", "val", "test")])
    assert np.array_equal(np.sort(all_rows), np.arange(len(table.label)))  # each row exactly once
    groups = {name: set(table.group[r].tolist()) for name, r in rows.items()}
    assert not groups["train"] & groups["val"]
    assert not groups["train"] & groups["test"]
    assert not groups["val"] & groups["test"]
    assert len(groups["test"]) == len(groups["val"]) == 18  # 15% of 120 requests
    again = split_rows(table.group, SplitConfig(seed=0))
    assert all(np.array_equal(rows[k], again[k]) for k in rows)
    other = split_rows(table.group, SplitConfig(seed=1))
    assert not np.array_equal(rows["test"], other["test"])


def test_split_by_seed_and_request_id():
    # Same request id in two runs (seeds): two requests, never merged.
    group = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    rows = split_rows(group, SplitConfig(seed=3, val_fraction=0.25, test_fraction=0.25))
    assert sorted(len(r) for r in rows.values()) == [2, 2, 4]
    with pytest.raises(ValueError, match="too few"):
        split_rows(np.array([0, 1]), SplitConfig())


def test_request_sequences_in_step_order():
    # Two requests, rows deliberately out of order; only the given rows are used.
    group = np.array([1, 0, 1, 0, 1, 0, 2])
    step = np.array([7, 2, 5, 1, 9, 3, 4])
    sequences = request_sequences(group, step, np.arange(6))
    # Request 0 in step order: rows 3 (1), 1 (2), 5 (3); request 1: rows 2 (5), 0 (7), 4 (9).
    assert sequences.rows.tolist() == [3, 1, 5, 2, 0, 4]
    assert sequences.starts.tolist() == [0, 3] and sequences.lengths.tolist() == [3, 3]
    assert request_sequences(group, step, np.array([6])).lengths.tolist() == [1]


def test_length_batches_hold_every_sequence_once_within_the_budget():
    lengths = np.random.default_rng(0).integers(1, 60, size=200)
    sampler = LengthBatchSampler(lengths, max_rows=128, shuffle=True, seed=3)
    passes = [list(sampler) for _ in range(2)]
    for batches in passes:
        assert sorted(i for batch in batches for i in batch) == list(range(200))
        assert all(len(b) == 1 or len(b) * lengths[b].max() <= 128 for b in batches)
    assert passes[0] != passes[1]  # a new order each pass
    assert list(LengthBatchSampler(lengths, 128, shuffle=True, seed=3)) == passes[0]  # seeded
    ordered = list(LengthBatchSampler(lengths, 128, shuffle=False))
    assert ordered == list(LengthBatchSampler(lengths, 128, shuffle=False))
    assert len(LengthBatchSampler(lengths, 128, shuffle=False)) == len(ordered)
    with pytest.raises(ValueError, match="batch_size"):
        LengthBatchSampler(lengths, 0, shuffle=False)


def test_batches_are_whole_histories_right_padded(data_path):
    datamodule = PreemptionDataModule(data_path, batch_size=64)
    datamodule.setup()
    batch = next(iter(datamodule.loader("test")))
    x, mask, rows = batch["x"], batch["mask"], batch["rows"]
    num_seqs, num_steps = mask.shape
    assert x.shape == (num_seqs, num_steps, 8) and num_seqs * num_steps <= 64 or num_seqs == 1
    table = datamodule.table
    test_groups = set(table.group[datamodule.rows["test"]].tolist())
    for i in range(num_seqs):
        real = rows[i][mask[i]].numpy()
        assert len(set(table.group[real].tolist())) == 1 and table.group[real[0]] in test_groups
        # The request's every row, from its first logged step, in step order.
        all_rows = np.flatnonzero(table.group == table.group[real[0]])
        assert real.tolist() == all_rows[np.argsort(table.step[all_rows])].tolist()
        np.testing.assert_array_equal(x[i][mask[i]].numpy(), table.features[real])
        assert mask[i].tolist() == sorted(mask[i].tolist(), reverse=True)  # padding at the end
        assert not x[i][~mask[i]].any() and (rows[i][~mask[i]] == -1).all()
        assert batch["label"][i][mask[i]].tolist() == table.label[real].tolist()


def test_stats_and_pos_weight_come_from_train_only(data_path):
    datamodule = PreemptionDataModule(data_path)
    datamodule.setup()
    train = datamodule.rows["train"]
    mean, std = datamodule.feature_stats()
    np.testing.assert_allclose(mean, datamodule.table.features[train].mean(axis=0), rtol=1e-5)
    assert std.shape == (8,) and np.all(std > 0)
    labels = datamodule.table.label[train]
    assert datamodule.pos_weight() == pytest.approx((len(labels) - labels.sum()) / labels.sum())


def test_rule_ranks_slice_used_requests_by_score(data_path):
    table = load_table(data_path)
    scores = rule_scores(table)
    used = table.features[:, COL["slice_usage"]] >= 1
    assert np.all(scores[~used] == 0)
    # At each step, exactly one slice-used request scores 1 (the lowest score_rank of them).
    for step in np.unique(table.step)[:20]:
        rows = np.flatnonzero((table.step == step) & used)
        if len(rows):
            best = rows[np.argmin(table.features[rows, COL["score_rank"]])]
            assert scores[best] == 1.0 and np.sum(scores[rows] == 1.0) == 1


def test_a_mix_records_every_dataset_s_trace_window(tmp_path):
    a = synthetic_dataset(tmp_path / "a", num_requests=30, window=("azure-conv", 1300.0, 200.0))
    b = synthetic_dataset(tmp_path / "b", num_requests=30, seed=1, window=("azure-code", 0.0, 600.0))
    assert load_table(a).meta["windows"] == [{"trace": "azure-conv", "start_s": 1300.0, "end_s": 1500.0}]
    assert load_table(f"{a},{b}").meta["windows"] == [
        {"trace": "azure-conv", "start_s": 1300.0, "end_s": 1500.0},
        {"trace": "azure-code", "start_s": 0.0, "end_s": 600.0},
    ]
    # a dataset without its collect config: no window known, none made up
    assert load_table(synthetic_dataset(tmp_path / "c", num_requests=30)).meta["windows"] == []
