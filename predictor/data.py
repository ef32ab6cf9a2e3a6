"""The features dataset as request histories: loading, the split by request, the batches.

Owns: reading a `preempt collect` dataset (`datasets.load_from_disk`, local disk only),
the deterministic split into train/val/test *by request* (a request's rows all land in
one split, so no request's history leaks from train into evaluation), each request's
rows as one sequence in step order (`Sequences`), batches of whole sequences of similar
length, the feature statistics fitted on the train split, and `PreemptionDataModule`.

Must never: split by row (neighbouring rows of one request are near-duplicates, and a
row-level split would grade the model on its own training history), fit anything on
val/test rows, or reach the network.

Why whole histories, not windows (train/serve consistency): online, the engine advances
each request's LSTM state by one step per logged step, from a zero state at the
request's first step (preempt.early.online_predictor). A model trained on windows of the last k steps
(each restarted from a zero state, earlier slots padded) would read states online that
it never saw in training. So training runs the LSTM over each request's whole logged
history from its first step, with a loss at every step, and the prediction for row i is
the output at row i's step: the same computation as online, step for step. Backprop is
truncated (predictor.model: `seq_len` steps), the forward pass never is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from preempt.core.workload import trace_window
from preempt.obs.dataset import dataset_meta

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
    num_tokens: np.ndarray | None = None  # (N,) int64 KV tokens computed; None in older datasets
    source: np.ndarray | None = None  # (N,) int64: which dataset of a mix the row came from
    kv_bytes_per_token: np.ndarray | None = None  # (N,) float64: its deployment's KV per token
    copy_bytes_per_s: np.ndarray | None = None  # (N,) float64: its device-to-host copy rate
    block_size: np.ndarray | None = None  # (N,) int64


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
    """Read a dataset written by `preempt collect` (or any with its schema); "a,b,c"
    reads a mix of datasets (requests stay apart: each source has its own groups). A mix
    must share its feature set and horizon, and `meta` is the first one's, with
    `sources` naming the traces."""
    paths = [p for p in str(path).split(",") if p]
    if len(paths) > 1:
        return _concat([_load_one(p, index) for index, p in enumerate(paths)])
    return _load_one(path, 0)


_SAME_IN_A_MIX = ("feature_set", "horizon_ms", "horizon_steps", "every_k_steps")


def _concat(tables: list[FeatureTable]) -> FeatureTable:
    first = tables[0].meta
    for table in tables[1:]:
        for key in _SAME_IN_A_MIX:
            if table.meta.get(key) != first.get(key):
                raise DataError(
                    f"datasets of a mix differ in {key}: {first.get(key)} vs {table.meta.get(key)}"
                )
    offsets = np.cumsum([0] + [int(t.group.max()) + 1 for t in tables[:-1]])
    columns = {}
    for name in FeatureTable._fields:
        if name == "meta":
            continue
        values = [getattr(t, name) for t in tables]
        if any(v is None for v in values):
            columns[name] = None
            continue
        if name == "group":
            values = [v + offset for v, offset in zip(values, offsets, strict=True)]
        columns[name] = np.concatenate(values)
    meta = dict(
        first,
        sources=[t.meta.get("trace") for t in tables],
        windows=[w for t in tables for w in t.meta.get("windows", [])],
    )
    return FeatureTable(meta=meta, **columns)


def _deployment(meta: dict[str, Any]) -> tuple[float, float, int]:
    """(KV bytes per token, copy bytes/s, block size) of the dataset's deployment."""
    from preempt.core.cost_model import CostModel
    from preempt.core.profiles import get_target

    config = meta.get("config") or {}
    target = (config.get("clock") or {}).get("target", "h200-llama3-8b")
    block_size = int((config.get("cache") or {}).get("block_size", 16))
    try:
        cost_model = CostModel(get_target(target))
    except (KeyError, ValueError, OSError):
        return 0.0, 0.0, block_size
    nbytes = 1e9
    rate = nbytes / max(cost_model.copy_time_s(nbytes) - cost_model.copy_time_s(0.0), 1e-12)
    return float(cost_model.target.kv_bytes_per_token), rate, block_size


def _load_one(path: str | Path, index: int) -> FeatureTable:
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
    meta = dataset_meta(dataset)
    window = trace_window(meta)
    meta["windows"] = [window] if window is not None else []
    num_rows = len(request_id)
    kv_bytes, rate, block_size = _deployment(meta)
    num_tokens = (
        table.column("num_tokens").to_numpy().astype(np.int64) if "num_tokens" in table.column_names else None
    )
    return FeatureTable(
        num_tokens=num_tokens,
        source=np.full(num_rows, index, dtype=np.int64),
        kv_bytes_per_token=np.full(num_rows, kv_bytes),
        copy_bytes_per_s=np.full(num_rows, rate),
        block_size=np.full(num_rows, block_size, dtype=np.int64),
        features=features,
        label=table.column("label").to_numpy().astype(np.int64),
        time_to_preemption_s=table.column("time_to_preemption_s").to_numpy().astype(np.float64),
        group=group.reshape(-1).astype(np.int64),
        seed=seed.astype(np.int64),
        step=table.column("step").to_numpy().astype(np.int64),
        t_s=table.column("t_s").to_numpy().astype(np.float64),
        meta=meta,
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


class Sequences(NamedTuple):
    """The rows of some requests as one sequence per request, in step order."""

    rows: np.ndarray  # (num_rows,) int64 row indices, sorted by (request, step)
    starts: np.ndarray  # (S,) int64: request k's rows are rows[starts[k] : starts[k] + lengths[k]]
    lengths: np.ndarray  # (S,) int64, >= 1


def request_sequences(group: np.ndarray, step: np.ndarray, rows: np.ndarray) -> Sequences:
    """The given rows as one sequence per request (group), each ordered by step."""
    rows = np.asarray(rows, dtype=np.int64)
    rows = rows[np.lexsort((step[rows], group[rows]))]  # by request, then step
    sorted_group = group[rows]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]]) if len(rows) else rows[:0]
    lengths = np.diff(np.r_[starts, len(rows)]).astype(np.int64)
    return Sequences(rows=rows, starts=starts.astype(np.int64), lengths=lengths)


class LengthBatchSampler(Sampler[list[int]]):
    """Lists of sequence indices whose padded size (count x longest) stays within
    `max_rows` (a longer sequence goes alone). Sequences of similar length share a batch,
    so little of a batch is padding.

    Shuffled: each pass draws a new order (seeded by (seed, pass)), sorts pools of
    `pool_size` sequences by length, cuts them into batches and shuffles the batches.
    Not shuffled: all sequences sorted by length, longest first, then cut."""

    def __init__(
        self, lengths: np.ndarray, max_rows: int, shuffle: bool, seed: int = 0, pool_size: int = 256
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"batch_size (rows per batch) must be >= 1, got {max_rows}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.max_rows = max_rows
        self.shuffle = shuffle
        self.seed = seed
        self.pool_size = pool_size
        self.num_passes = 0

    def _cut(self, order: np.ndarray) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for index in order.tolist():
            length = int(self.lengths[index])
            if current and max(longest, length) * (len(current) + 1) > self.max_rows:
                batches.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, length)
        if current:
            batches.append(current)
        return batches

    def _batches(self) -> list[list[int]]:
        if not self.shuffle:
            return self._cut(np.argsort(-self.lengths, kind="stable"))
        rng = np.random.default_rng([self.seed, self.num_passes])
        order = rng.permutation(len(self.lengths))
        batches: list[list[int]] = []
        for first in range(0, len(order), self.pool_size):
            pool = order[first : first + self.pool_size]
            batches += self._cut(pool[np.argsort(-self.lengths[pool], kind="stable")])
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        self.num_passes += 1
        return iter(batches)

    def __len__(self) -> int:
        # Deterministic without shuffling; with shuffling, the count of the next pass.
        if not self.shuffle:
            return len(self._batches())
        saved = self.num_passes
        count = len(self._batches())
        self.num_passes = saved
        return count


class SequenceBatches(Dataset):
    """Whole request histories, indexed by a *list* of sequence indices (use with
    `LengthBatchSampler` and batch_size=None): one fancy-indexing gather per batch.

    A batch: x (B, T, 8) raw features, right-padded with zeros; mask (B, T) False on
    padding; label (B, T) float; rows (B, T) int64 row index in the table, -1 on padding
    (to put predictions back in row order)."""

    def __init__(self, table: FeatureTable, rows: np.ndarray) -> None:
        self.sequences = request_sequences(table.group, table.step, rows)
        # A zero row at the end stands for padding (index -1 reads it).
        self.features = torch.from_numpy(np.concatenate([table.features, np.zeros((1, 8), np.float32)]))
        self.label = torch.from_numpy(np.r_[table.label.astype(np.float32), np.float32(0)])

    def __len__(self) -> int:
        return len(self.sequences.lengths)

    def __getitem__(self, index: list[int]) -> dict[str, torch.Tensor]:
        starts = self.sequences.starts[index]  # (B,)
        lengths = self.sequences.lengths[index]  # (B,)
        position = np.arange(int(lengths.max()))  # (T,)
        is_real = position[None, :] < lengths[:, None]  # (B, T)
        flat = np.minimum(starts[:, None] + position[None, :], len(self.sequences.rows) - 1)
        rows = torch.from_numpy(np.where(is_real, self.sequences.rows[flat], -1))  # (B, T)
        return {
            "x": self.features[rows],  # (B, T, 8); -1 picks the zero row
            "mask": rows >= 0,  # (B, T)
            "label": self.label[rows],  # (B, T)
            "rows": rows,  # (B, T)
        }


class PreemptionDataModule(pl.LightningDataModule):
    """Train/val/test request histories of one features dataset, split by request."""

    def __init__(
        self,
        data_path: str | Path,
        batch_size: int = 4096,
        split: SplitConfig | None = None,
    ) -> None:
        super().__init__()
        self.data_path = Path(data_path)
        self.batch_size = batch_size
        """Rows (logged steps, padding included) per batch."""
        self.split = split or SplitConfig()
        self.table: FeatureTable | None = None
        self.rows: dict[str, np.ndarray] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.table is not None:
            return
        self.table = load_table(self.data_path)
        self.rows = split_rows(self.table.group, self.split)

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
    def batches(self, split: str) -> SequenceBatches:
        return SequenceBatches(self.table, self.rows[split])

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        return sequence_loader(self.batches(split), self.batch_size, shuffle=shuffle, seed=self.split.seed)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.loader("test", shuffle=False)


def sequence_loader(
    data: SequenceBatches, batch_size: int, shuffle: bool = False, seed: int = 0
) -> DataLoader:
    """Batches of whole request histories of at most `batch_size` rows (padding included)."""
    sampler = LengthBatchSampler(data.sequences.lengths, batch_size, shuffle=shuffle, seed=seed)
    # batch_size=None: the sampler's index lists reach __getitem__ whole.
    return DataLoader(data, sampler=sampler, batch_size=None)
