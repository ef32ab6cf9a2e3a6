"""Scheduling features and preemption labels for the learned predictor (SPEC §8).

Owns: the 8 features logged per running request at a step (`FEATURE_NAMES`, documented
in `FEATURE_DOCS`), the `FeatureLogger` hook that records them during a replay, the
labels computed after the run from the scheduler's preemption records, and the
`datasets.Dataset` that holds both (schema: DESIGN.md "Files").

Feature choice: the SPEC's "past preemptions, sequence length, slice usage, ..." plus what
decides who is preempted. The victim of both triggers is the lowest-scored running
request (priority_score policy), which no per-request feature can tell on its own, so
`score_rank` places the request among the running ones; it replaced the request's age
(which enters only through the score): the LSTM's test AUPRC went from 0.15 to 0.46 with
it (collect.yaml over 300 s of trace at 3x, every 2nd step; 3 epochs; same split), the
other two candidates to drop (sla_level, seq_ktokens) reached 0.26 and 0.37.

Must never: read the future when computing a feature (no `target_output_tokens`, no
later step's state: a feature at step t depends only on what the scheduler knew after
step t), change any request or scheduler state, or import torch (the engine's hot path
calls `FeatureLogger` every step; `datasets` is imported only when a dataset is built).

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

from preempt.core.config import PreemptionConfig
from preempt.core.request import Request
from preempt.engine.priority import priority_scores, remaining_ktokens, time_slice_s

if TYPE_CHECKING:
    from datasets import Dataset

    from preempt.engine.engine import Engine, StepOutput
    from preempt.kv.record import PreemptionRecord

FEATURE_NAMES: tuple[str, ...] = (
    "num_preemptions",
    "seq_ktokens",
    "slice_usage",
    "score_rank",
    "sla_level",
    "remaining_ktokens",
    "queue_pressure",
    "free_kv_fraction",
)
"""Names of the 8 features, in column order (a *contract* with trained checkpoints)."""

FEATURE_DOCS: dict[str, str] = {
    "num_preemptions": "times this request was preempted so far (count)",
    "seq_ktokens": "current length, prompt + generated tokens, in thousands of tokens",
    "slice_usage": "executed time since it last started running / its time slice "
    "(>= 1: eligible as a priority victim)",
    "score_rank": "running requests with a strictly lower SPEC priority score (0: this is "
    "the lowest, the priority_score policy's next victim), count",
    "sla_level": "service class (higher = more important)",
    "remaining_ktokens": "estimated remaining work from max_tokens, thousands of tokens "
    "(preempt.engine.priority.remaining_ktokens; never the true output length)",
    "queue_pressure": "waiting requests whose priority score beats this one's by the "
    "trigger margin (preempt.engine.priority.beats), count",
    "free_kv_fraction": "free KV blocks / all KV blocks (same for every request of a step)",
}
NUM_FEATURES = len(FEATURE_NAMES)

SCALE_FREE_NAMES: tuple[str, ...] = (
    "num_preemptions",
    "pool_share",
    "slice_usage",
    "rank_share",
    "sla_level",
    "need_share",
    "queue_share",
    "free_kv_fraction",
)
"""The `scale_free` feature set: the same 8 slots, none of them in tokens, requests or
seconds, so a model fitted on one trace reads another trace's values in the same range
(mooncake's requests are ~7x longer than azure-conv's and its pool ~16x larger)."""

SCALE_FREE_DOCS: dict[str, str] = {
    "num_preemptions": FEATURE_DOCS["num_preemptions"],
    "pool_share": "KV blocks this request holds / all KV blocks",
    "slice_usage": FEATURE_DOCS["slice_usage"],
    "rank_share": "score_rank / (running requests - 1): 0 = the lowest score, the next victim",
    "sla_level": FEATURE_DOCS["sla_level"],
    "need_share": "KV blocks it still needs to reach max_tokens / free KV blocks (capped at 10)",
    "queue_share": "waiting requests that beat it by the trigger margin / max_num_seqs "
    "(a share of the batch's seats; capped at 10)",
    "free_kv_fraction": FEATURE_DOCS["free_kv_fraction"],
}

FEATURE_SETS: dict[str, tuple[str, ...]] = {"v1": FEATURE_NAMES, "scale_free": SCALE_FREE_NAMES}
"""Feature sets by name; a checkpoint records the one it was trained on, and the online
predictor refuses another."""
_NEED_CAP = 10.0

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
    """`v1` (FEATURE_NAMES) or `scale_free` (SCALE_FREE_NAMES)."""

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


def compute_features(
    running: Sequence[Request],
    waiting: Sequence[Request] | np.ndarray,
    now: float,
    num_free_blocks: int,
    num_blocks: int,
    preemption: PreemptionConfig,
) -> np.ndarray:
    """The features of each running request, (R, 8) float32 in FEATURE_NAMES order.
    `waiting`: the waiting requests, or their priority scores at `now` already computed
    (`Scheduler.waiting_scores`, the fast path the engine hooks use).

    Uses only what the scheduler knows at `now`; never mutates anything."""
    weights = preemption.priority_weights
    scores = priority_scores(running, now, weights)
    sorted_scores = np.sort(scores)
    # Queue pressure: a waiting request w beats r when s_w > s_r + thr * max(|s_r|, floor);
    # with the waiting scores sorted, that is one searchsorted per running request.
    waiting_scores = np.sort(
        waiting if isinstance(waiting, np.ndarray) else priority_scores(waiting, now, weights)
    )
    bars = scores + preemption.threshold * np.maximum(np.abs(scores), preemption.score_floor)
    num_beating = len(waiting_scores) - np.searchsorted(waiting_scores, bars, side="right")
    out = np.empty((len(running), NUM_FEATURES), dtype=np.float32)
    out[:, 0] = [r.num_preemptions for r in running]
    out[:, 1] = [r.num_tokens / 1000.0 for r in running]
    out[:, 2] = [r.slice_used_s / time_slice_s(r, preemption) for r in running]
    out[:, 3] = np.searchsorted(sorted_scores, scores, side="left")  # strictly lower scores
    out[:, 4] = [r.sla_level for r in running]
    out[:, 5] = [remaining_ktokens(r) for r in running]
    out[:, 6] = num_beating
    out[:, 7] = num_free_blocks / num_blocks
    return out


def scale_free_features(
    running: Sequence[Request],
    waiting_scores: np.ndarray,
    now: float,
    num_free_blocks: int,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    preemption: PreemptionConfig,
) -> np.ndarray:
    """The `scale_free` set (SCALE_FREE_NAMES), (R, 8) float32, from the `v1` columns
    and the pool: shares of the pool, of the running requests and of the batch's seats."""
    v1 = compute_features(running, waiting_scores, now, num_free_blocks, num_blocks, preemption)
    num_running = len(running)
    out = np.empty_like(v1)
    out[:, 0] = v1[:, 0]
    held = np.fromiter((len(r.block_ids) for r in running), np.float32, num_running)
    out[:, 1] = held / num_blocks
    out[:, 2] = v1[:, 2]
    out[:, 3] = v1[:, 3] / max(1, num_running - 1)
    out[:, 4] = v1[:, 4]
    final_tokens = np.fromiter((r.num_prompt_tokens + r.max_tokens for r in running), np.float32, num_running)
    need = np.maximum(0.0, np.ceil(final_tokens / block_size) - held)
    out[:, 5] = np.minimum(need / max(1, num_free_blocks), _NEED_CAP)
    out[:, 6] = np.minimum(v1[:, 6] / max_num_seqs, _NEED_CAP)
    out[:, 7] = v1[:, 7]
    return out


def engine_features(engine: Engine, feature_set: str = "v1") -> np.ndarray:
    """The features (`feature_set`) of the engine's running requests now, (R, 8): what
    the feature logger records and what the early-save policies decide on."""
    scheduler = engine.scheduler
    now = engine.clock.now()
    args = (
        scheduler.running,
        scheduler.waiting_scores(now),
        now,
        engine.block_pool.num_free,
        engine.block_pool.num_blocks,
    )
    if feature_set == "scale_free":
        return scale_free_features(
            *args, engine.block_size, scheduler.config.max_num_seqs, engine.config.preemption
        )
    return compute_features(*args, engine.config.preemption)


class FeatureLogger:
    """An `on_step` hook (`hook(engine, output)`) that records features of running requests.

    Rows accumulate in Python lists (cheap appends in the hot loop); `columns()` labels
    them from the scheduler's records once the run is over."""

    def __init__(self, config: FeatureConfig | None = None) -> None:
        self.config = config or FeatureConfig()
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

    def __call__(self, engine: Engine, output: StepOutput) -> None:
        if not output.scheduled.chunks:
            return
        self._step_ends.append(engine.clock.now())
        if engine.num_steps % self.config.every_k_steps:
            return
        scheduler = engine.scheduler
        running = scheduler.running
        if not running:
            return
        now = engine.clock.now()
        features = engine_features(engine, self.config.feature_set)
        self._num_tokens.append(np.fromiter((r.num_computed_tokens for r in running), np.int64, len(running)))
        self._request_ids.append(np.fromiter((r.request_id for r in running), np.int64, len(running)))
        self._steps.append(engine.num_steps)
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
        if record.action != "none" and record.reason != "reclaim":
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
    """A `datasets.Dataset` with the DESIGN.md schema; `info` (trace, config, seed,
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
    docs = SCALE_FREE_DOCS if feature_set == "scale_free" else FEATURE_DOCS
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


def save_dataset(columns: dict[str, np.ndarray], info: dict[str, Any], path: str | Path) -> Dataset:
    dataset = build_dataset(columns, info)
    dataset.save_to_disk(str(path))
    return dataset
