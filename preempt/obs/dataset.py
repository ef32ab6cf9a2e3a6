"""The predictor's training set: feature rows logged during a replay, labelled after it.

Owns: `FeatureLogger`, the `on_step` hook of `preempt collect` that records the features
(`preempt.early.features`: their names and how they are computed) of every running
request, the labels computed after the run from the scheduler's preemption records, and
the `datasets.Dataset` that holds both (its columns: `FeatureLogger.columns`).

Must never: change any request or scheduler state, or import torch (the logger runs
every step; `datasets` is imported only when a dataset is built).

When a row is taken: after each step that ran something (`Engine.run(on_step=...)`), for
every request still running. The row's `t_s` is the engine clock after the step: the
moment the next `schedule(t_s)` decides preemptions, so a preemption record with
`time_s >= t_s` lies in the row's future. Steps that ran nothing are skipped: no request
advanced, and the preemptions they decided carry the time such a row would have, where
they would read as its future.

Labels (computed after the run, they are the only place the future enters):
- events: records whose KV action is not "none" (a failed attempt kept the request
  running) and whose reason is not "reclaim" (a paused request's deferred save: it had
  already left the batch, and its pause was the event);
- `time_to_preemption_s`: time from the row to the request's next event at or after
  `t_s` (inf if none);
- `label` = 1 when that time is <= horizon (inclusive, with 1e-9 s slack for the float
  sums of the engine clock).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from preempt.early.features import FEATURE_SET_DOCS, FEATURE_SETS, NUM_FEATURES, Features

if TYPE_CHECKING:
    from datasets import Dataset

    from preempt.engine.view import EngineView, StepOutput
    from preempt.kv.record import PreemptionRecord

# Engine-clock times are float sums of step durations: t + 0.05 and the record's time can
# differ in the last bit, so the horizon is inclusive with this slack.
_HORIZON_SLACK_S = 1e-9


@dataclass(frozen=True)
class FeatureConfig:
    """How features are logged and labelled (`preempt collect` flags)."""

    every_k_steps: int = 1
    """Log the running requests after every k-th step that ran something."""
    horizon_ms: float = 50.0
    """A row is positive when its request is preempted within this many ms (engine clock)."""
    horizon_steps: int = 0
    """... or within this many engine steps, whichever reaches further (0: time only). With
    long prompts one step can outlast any fixed time horizon."""
    feature_set: str = "v1"
    """`v1` (FEATURE_NAMES), `scale_free` (SCALE_FREE_NAMES) or `forecast` (FORECAST_NAMES:
    forks the engine, virtual clock only); preempt.early.features.FEATURE_SETS."""

    def __post_init__(self) -> None:
        if self.every_k_steps < 1:
            raise ValueError(f"features.every_k_steps must be >= 1, got {self.every_k_steps}")
        if not self.horizon_ms > 0:
            raise ValueError(f"features.horizon_ms must be > 0, got {self.horizon_ms}")
        if self.horizon_steps < 0:
            raise ValueError(f"features.horizon_steps must be >= 0, got {self.horizon_steps}")
        if self.feature_set not in FEATURE_SETS:
            raise ValueError(
                f"features.feature_set must be one of {sorted(FEATURE_SETS)}, got '{self.feature_set}'"
            )

    @staticmethod
    def parse(name: str, raw: str) -> int | float | str:
        """A `--set features.NAME=RAW` value with the field's type."""
        if name == "feature_set":
            return raw.strip()
        return int(raw) if name in ("every_k_steps", "horizon_steps") else float(raw)

    def meta(self) -> dict[str, Any]:
        """What a dataset (and a checkpoint trained on it) records about its labels and features."""
        return {
            "horizon_ms": self.horizon_ms,
            "horizon_steps": self.horizon_steps,
            "every_k_steps": self.every_k_steps,
            "feature_set": self.feature_set,
        }


class FeatureLogger:
    """An `on_step` hook (`hook(engine, output)`) that records features of running requests.

    Rows accumulate in Python lists (cheap appends in the hot loop); `columns()` labels
    them from the scheduler's records once the run is over."""

    def __init__(self, config: FeatureConfig | None = None) -> None:
        self.config = config or FeatureConfig()
        config = self.config
        self.source = Features(config.feature_set, config.horizon_ms, config.horizon_steps)
        self._request_ids: list[np.ndarray] = []
        self._steps: list[int] = []
        self._counts: list[int] = []
        self._times: list[float] = []
        self._features: list[np.ndarray] = []
        self._num_tokens: list[np.ndarray] = []
        self._step_ends: list[float] = []  # every step that ran something: the step horizon

    @property
    def num_rows(self) -> int:
        return sum(self._counts)

    def __call__(self, view: EngineView, output: StepOutput) -> None:
        if output.finished:
            self.source.note_finished(output.finished)
        if not output.scheduled.chunks:
            return
        self._step_ends.append(view.now)
        if view.num_steps % self.config.every_k_steps:
            return
        running = view.running
        if not running:
            return
        now = view.now
        features = self.source(view)
        self._num_tokens.append(np.fromiter((r.num_computed_tokens for r in running), np.int64, len(running)))
        self._request_ids.append(np.fromiter((r.request_id for r in running), np.int64, len(running)))
        self._steps.append(view.num_steps)
        self._counts.append(len(running))
        self._times.append(now)
        self._features.append(features)

    def columns(self, records: Sequence[PreemptionRecord]) -> dict[str, np.ndarray]:
        """All rows so far, labelled: request_id, step, t_s, features (N, 8), label,
        time_to_preemption_s, steps_to_preemption, num_tokens (KV tokens computed)."""
        counts = np.asarray(self._counts, dtype=np.int64)
        request_ids = np.concatenate(self._request_ids) if self._request_ids else np.zeros(0, np.int64)
        t_s = np.repeat(np.asarray(self._times, dtype=np.float64), counts)
        features = (
            np.concatenate(self._features) if self._features else np.zeros((0, NUM_FEATURES), np.float32)
        )
        label, time_to, steps_to = label_rows(
            request_ids,
            t_s,
            records,
            self.config.horizon_ms / 1000.0,
            horizon_steps=self.config.horizon_steps,
            step_ends=np.asarray(self._step_ends, dtype=np.float64),
        )
        num_tokens = np.concatenate(self._num_tokens) if self._num_tokens else np.zeros(0, np.int64)
        return {
            "request_id": request_ids,
            "step": np.repeat(np.asarray(self._steps, dtype=np.int64), counts),
            "t_s": t_s,
            "features": features,
            "label": label,
            "time_to_preemption_s": time_to,
            "steps_to_preemption": steps_to,
            "num_tokens": num_tokens,
        }


def preemption_events(records: Sequence[PreemptionRecord]) -> dict[int, np.ndarray]:
    """request_id -> sorted times at which it was taken out of the batch (see module doc)."""
    times: dict[int, list[float]] = {}
    for record in records:
        if record.is_preemption:
            times.setdefault(record.request_id, []).append(record.time_s)
    return {rid: np.sort(np.asarray(ts, dtype=np.float64)) for rid, ts in times.items()}


def label_rows(
    request_ids: np.ndarray,
    t_s: np.ndarray,
    records: Sequence[PreemptionRecord],
    horizon_s: float,
    horizon_steps: int = 0,
    step_ends: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(label int64 (N,), time_to_preemption_s float64 (N,), steps_to_preemption int64
    (N,)) for rows (request_id, t_s). Steps to a preemption: 1 for the next schedule(),
    plus the steps that ended after the row and by the preemption (`step_ends`: the end
    time of every step that ran something; without it, steps are not counted: -1).
    A row is positive within `horizon_s` or within `horizon_steps` steps."""
    events = preemption_events(records)
    time_to = np.full(len(request_ids), math.inf, dtype=np.float64)
    # Rows grouped by request once (stable sort), instead of one scan of all rows per request.
    order = np.argsort(request_ids, kind="stable")
    sorted_ids = request_ids[order]
    for rid, event_times in events.items():
        lo, hi = np.searchsorted(sorted_ids, [rid, rid + 1])
        rows = order[lo:hi]
        nxt = np.searchsorted(event_times, t_s[rows], side="left")  # first event at or after t
        has_next = nxt < len(event_times)
        time_to[rows[has_next]] = event_times[nxt[has_next]] - t_s[rows[has_next]]
    label = time_to <= horizon_s + _HORIZON_SLACK_S
    steps_to = np.full(len(request_ids), -1, dtype=np.int64)
    if step_ends is not None:
        has = np.isfinite(time_to)
        event_t = t_s[has] + time_to[has]
        after = np.searchsorted(step_ends, t_s[has] + _HORIZON_SLACK_S, side="right")
        by = np.searchsorted(step_ends, event_t + _HORIZON_SLACK_S, side="right")
        steps_to[has] = 1 + np.maximum(0, by - after)
        if horizon_steps > 0:
            label[has] |= steps_to[has] <= horizon_steps
    return label.astype(np.int64), time_to, steps_to


_OPTIONAL_COLUMNS = ("steps_to_preemption", "num_tokens")  # absent in datasets of older collects


def build_dataset(columns: dict[str, np.ndarray], info: dict[str, Any]) -> Dataset:
    """A `datasets.Dataset` with the schema of docs/design.md "Files"; `info` (trace, config, seed,
    horizon, feature names and docs) goes into `info.description` as JSON, and the seed
    also into a column so datasets from several runs can be concatenated and still split
    by (seed, request_id)."""
    # late: pyarrow + datasets cost ~1 s, and the engine never needs them
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    list_type = getattr(datasets, "List", None) or datasets.Sequence  # List: datasets >= 4
    features = datasets.Features(
        {
            "request_id": datasets.Value("int64"),
            "seed": datasets.Value("int64"),
            "step": datasets.Value("int64"),
            "t_s": datasets.Value("float64"),
            "features": list_type(datasets.Value("float32"), length=NUM_FEATURES),
            "label": datasets.Value("int64"),
            "time_to_preemption_s": datasets.Value("float64"),
            **{name: datasets.Value("int64") for name in _OPTIONAL_COLUMNS if name in columns},
        }
    )
    num_rows = len(columns["request_id"])
    data = dict(columns)
    data["seed"] = np.full(num_rows, int(info.get("seed", 0)), dtype=np.int64)
    feature_set = info.get("feature_set", "v1")
    names = FEATURE_SETS[feature_set]
    docs = FEATURE_SET_DOCS[feature_set]
    meta = {"feature_names": list(names), "feature_docs": docs, **info}
    ds_info = datasets.DatasetInfo(description=json.dumps(meta), features=features)
    # Arrow takes (N, 8) float32 as a fixed-size list column without a Python loop, and
    # the columns already have the schema's types, so no (row-by-row) cast is needed.
    arrays = {
        name: (
            pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), NUM_FEATURES)
            if name == "features"
            else pa.array(values)
        )
        for name, values in data.items()
    }
    table = pa.table({name: arrays[name] for name in features}, schema=features.arrow_schema)
    return datasets.Dataset(InMemoryTable(table), info=ds_info)


def dataset_meta(dataset: Dataset) -> dict[str, Any]:
    """The JSON metadata `build_dataset` stored in `info.description`."""
    return json.loads(dataset.info.description or "{}")


def save_dataset(
    columns: dict[str, np.ndarray], info: dict[str, Any], path: str | Path, progress: bool = True
) -> Dataset:
    """The dataset built and written to `path`; `progress=False` keeps `datasets`' own
    progress bar off while it writes (`preempt collect --no-progress`)."""
    import datasets

    dataset = build_dataset(columns, info)
    if progress or datasets.utils.are_progress_bars_disabled():
        dataset.save_to_disk(str(path))
        return dataset
    datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(path))
    finally:
        datasets.enable_progress_bars()
    return dataset
