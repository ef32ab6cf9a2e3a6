"""The split by request, the windows and the train-only statistics (predictor.data)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from predictor.baselines import rule_scores
from predictor.data import PreemptionDataModule, SplitConfig, load_table, split_rows, window_index
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


def test_window_index_left_pads_in_step_order():
    # Two requests, rows deliberately out of order.
    group = np.array([1, 0, 1, 0, 1, 0])
    step = np.array([7, 2, 5, 1, 9, 3])
    windows = window_index(group, step, seq_len=3)
    # Request 1 in step order: rows 2 (5), 0 (7), 4 (9); request 0: rows 3 (1), 1 (2), 5 (3).
    expected = {2: [-1, -1, 2], 0: [-1, 2, 0], 4: [2, 0, 4], 3: [-1, -1, 3], 1: [-1, 3, 1], 5: [3, 1, 5]}
    for row, window in expected.items():
        assert windows[row].tolist() == window


def test_batches_gather_windows_with_mask(data_path):
    datamodule = PreemptionDataModule(data_path, seq_len=4, batch_size=8)
    datamodule.setup()
    batch = next(iter(datamodule.loader("test")))
    assert batch["x"].shape == (8, 4, 8) and batch["mask"].shape == (8, 4)
    table, windows = datamodule.table, datamodule.windows
    rows = datamodule.rows["test"][:8]
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(batch["mask"][i].numpy(), windows[row] >= 0)
        np.testing.assert_array_equal(batch["x"][i, -1].numpy(), table.features[row])  # the row is last
        assert not batch["x"][i][~batch["mask"][i]].any()  # padding is zero
    assert batch["label"].tolist() == table.label[rows].tolist()


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
