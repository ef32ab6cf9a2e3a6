"""The features dataset as training windows: loading, the split by request, the windows.

Owns: reading a `preempt collect` dataset (`datasets.load_from_disk`, local disk only),
the deterministic split into train/val/test *by request* (a request's rows all land in
one split, so no request's history leaks from train into evaluation), the windows of the
last `seq_len` logged steps of a request (left-padded, with a mask), the feature
statistics fitted on the train split, and `PreemptionDataModule`.

Must never: split by row (neighbouring rows of one request are near-duplicates, and a
row-level split would grade the model on its own training history), fit anything on
val/test rows, or reach the network.

Windows: row i's window holds the rows of the same request with step <= step_i, the last
`seq_len` of them in step order, row i last. Earlier slots are padding (`mask` False);
the model zeroes them after standardising, so padding reads as "average" input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

SPLITS = ("train", "val", "test")


class DataError(ValueError):
    """A features dataset that cannot be used; the message names the path or the problem."""


class FeatureTable(NamedTuple):
    """A features dataset as numpy arrays, one entry per row."""

    features: np.ndarray  # (N, 8) float32
    label: np.ndarray  # (N,) int64
    time_to_preemption_s: np.ndarray  # (N,) float64, inf when never preempted again
    group: np.ndarray  # (N,) int64: one id per (seed, request_id), the unit of the split
    seed: np.ndarray  # (N,) int64: the run's seed (rows of one step share seed and step)
    step: np.ndarray  # (N,) int64
    t_s: np.ndarray  # (N,) float64, engine clock
    meta: dict[str, Any]  # the dataset's info.description (feature names, config, ...)


@dataclass(frozen=True)
class SplitConfig:
    seed: int = 0
    """Seeds the shuffle of requests into splits (same seed, same data -> same split)."""
    val_fraction: float = 0.15
    test_fraction: float = 0.15

    def __post_init__(self) -> None:
        if not (0 < self.val_fraction < 1 and 0 < self.test_fraction < 1):
            raise ValueError("val_fraction and test_fraction must be in (0, 1)")
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave rows for training")


def load_table(path: str | Path) -> FeatureTable:
    """Read a dataset written by `preempt collect` (or any with its schema)."""
    import datasets  # late: ~1 s; the training CLI pays it anyway

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"features dataset not found: {path} (write one with `preempt collect`)")
    dataset = datasets.load_from_disk(str(path))
    table = dataset.data.table  # Arrow: column access without a Python loop per row
    features = (
        table.column("features").combine_chunks().flatten().to_numpy().astype(np.float32).reshape(-1, 8)
    )
    request_id = table.column("request_id").to_numpy()
    seed = table.column("seed").to_numpy() if "seed" in table.column_names else np.zeros_like(request_id)
    _, group = np.unique(np.stack([seed, request_id], axis=1), axis=0, return_inverse=True)
    return FeatureTable(
        features=features,
        label=table.column("label").to_numpy().astype(np.int64),
        time_to_preemption_s=table.column("time_to_preemption_s").to_numpy().astype(np.float64),
        group=group.reshape(-1).astype(np.int64),
        seed=seed.astype(np.int64),
        step=table.column("step").to_numpy().astype(np.int64),
        t_s=table.column("t_s").to_numpy().astype(np.float64),
        meta=json.loads(dataset.info.description or "{}"),
    )


def split_rows(group: np.ndarray, config: SplitConfig) -> dict[str, np.ndarray]:
    """Row indices of each split; whole groups (requests) go to one split."""
    groups = np.unique(group)
    order = np.random.default_rng(config.seed).permutation(groups)
    num_test = max(1, round(config.test_fraction * len(groups)))
    num_val = max(1, round(config.val_fraction * len(groups)))
    if num_test + num_val >= len(groups):
        raise DataError(f"{len(groups)} requests are too few for a train/val/test split")
    member = {
        "test": order[:num_test],
        "val": order[num_test : num_test + num_val],
        "train": order[num_test + num_val :],
    }
    return {name: np.flatnonzero(np.isin(group, member[name])) for name in SPLITS}


def window_index(group: np.ndarray, step: np.ndarray, seq_len: int) -> np.ndarray:
    """(N, seq_len) int64 row indices of each row's window, oldest first; -1 = padding."""
    order = np.lexsort((step, group))  # by request, then step
    sorted_group = group[order]
    is_start = np.ones(len(order), dtype=bool)
    is_start[1:] = sorted_group[1:] != sorted_group[:-1]
    start = np.maximum.accumulate(np.where(is_start, np.arange(len(order)), 0))
    position = np.arange(len(order)) - start  # index of the row within its request
    lags = np.arange(seq_len - 1, -1, -1)  # (T,): column T-1 is the row itself
    sorted_index = np.arange(len(order))[:, None] - lags[None, :]  # (N, T) positions in `order`
    valid = position[:, None] >= lags[None, :]
    windows_sorted = np.where(valid, order[np.clip(sorted_index, 0, None)], -1)
    windows = np.empty_like(windows_sorted)
    windows[order] = windows_sorted
    return windows


class WindowBatches(Dataset):
    """Indexed by a *list* of row positions (use with a BatchSampler and batch_size=None):
    one fancy-indexing gather per batch instead of a Python call per row."""

    def __init__(self, table: FeatureTable, rows: np.ndarray, windows: np.ndarray) -> None:
        # A zero row at the end stands for padding (index -1 reads it).
        self.features = torch.from_numpy(np.concatenate([table.features, np.zeros((1, 8), np.float32)]))
        self.rows = rows
        self.windows = torch.from_numpy(windows[rows])  # (n, T)
        self.label = torch.from_numpy(table.label[rows].astype(np.float32))
        self.time_to = torch.from_numpy(table.time_to_preemption_s[rows])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: list[int]) -> dict[str, torch.Tensor]:
        windows = self.windows[index]  # (B, T)
        return {
            "x": self.features[windows],  # (B, T, 8); -1 picks the zero row
            "mask": windows >= 0,  # (B, T)
            "label": self.label[index],  # (B,)
            "time_to_preemption_s": self.time_to[index],  # (B,)
        }


class PreemptionDataModule(pl.LightningDataModule):
    """Train/val/test windows of one features dataset, split by request."""

    def __init__(
        self,
        data_path: str | Path,
        seq_len: int = 16,
        batch_size: int = 512,
        split: SplitConfig | None = None,
    ) -> None:
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.data_path = Path(data_path)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.split = split or SplitConfig()
        self.table: FeatureTable | None = None
        self.rows: dict[str, np.ndarray] = {}
        self.windows: np.ndarray | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.table is not None:
            return
        self.table = load_table(self.data_path)
        self.rows = split_rows(self.table.group, self.split)
        self.windows = window_index(self.table.group, self.table.step, self.seq_len)

    # ----------------------------------------------------------------- fitted on train
    def feature_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-feature mean and std (8,) of the train rows; std floored so a constant
        feature (e.g. one SLA level) standardises to 0 instead of dividing by 0."""
        train = self.table.features[self.rows["train"]].astype(np.float64)
        return train.mean(axis=0).astype(np.float32), np.maximum(train.std(axis=0), 1e-6).astype(np.float32)

    def pos_weight(self) -> float:
        """negatives / positives in train: weights the BCE so both classes count equally."""
        labels = self.table.label[self.rows["train"]]
        num_pos = int(labels.sum())
        return float(len(labels) - num_pos) / max(num_pos, 1)

    # ----------------------------------------------------------------- loaders
    def batches(self, split: str) -> WindowBatches:
        return WindowBatches(self.table, self.rows[split], self.windows)

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        data = self.batches(split)
        if shuffle:
            generator = torch.Generator().manual_seed(self.split.seed)
            sampler = RandomSampler(data, generator=generator)
        else:
            sampler = SequentialSampler(data)
        # batch_size=None: the BatchSampler's index lists reach __getitem__ whole.
        return DataLoader(
            data, sampler=BatchSampler(sampler, self.batch_size, drop_last=False), batch_size=None
        )

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.loader("test", shuffle=False)
