"""Scheduling features: what a policy may know of a running request (docs/design.md §8).

Owns: the 8 features of each running request at a step (`FEATURE_NAMES`, documented in
`FEATURE_DOCS`; the `scale_free` and `forecast` sets beside them) and how they are
computed from the engine's state after a step (`engine_features` for the stateless sets;
`Features` for any set along a run, keeping the `forecast` set's fork current). Read
online by the early-save policies and logged offline into the predictor's training set
(`preempt.obs.dataset`, which also computes the labels: the only place the future
enters).

Feature choice: docs/design.md §8's "past preemptions, sequence length, slice usage, ..." plus what
decides who is preempted. The victim of both triggers is the lowest-scored running
request (priority_score policy), which no per-request feature can tell on its own, so
`score_rank` places the request among the running ones; it replaced the request's age
(which enters only through the score): the LSTM's test AUPRC went from 0.15 to 0.46 with
it (collect.yaml over 300 s of trace at 3x, every 2nd step; 3 epochs; same split), the
other two candidates to drop (sla_level, seq_ktokens) reached 0.26 and 0.37.

Must never: read the future when computing a feature (no `target_output_tokens`, no
later step's state: a feature at step t depends only on what the scheduler knew after
step t), change any request or scheduler state, or import torch (the engine's hot path
computes them every step an early-save policy or the feature logger asks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from preempt.core.config import PreemptionConfig
from preempt.core.request import Request
from preempt.engine.priority import age_terms, priority_scores, remaining_ktokens, time_slice_s

if TYPE_CHECKING:
    from preempt.early.lookahead import RollingForecast
    from preempt.engine.view import EngineView

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
    "score_rank": "running requests with a strictly lower priority score (0: this is "
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
    "headroom",
)
"""The `scale_free` feature set: the same 8 slots, none of them in tokens, requests or
seconds, so a model fitted on one trace reads another trace's values in the same range
(mooncake's requests are ~7x longer than azure-conv's and its pool ~16x larger).

`headroom`, not the free KV share: both triggers need the queue's head to be refused, by
the pool *or* by the batch's seats. On azure-conv the pool refuses (median free KV 4%),
on mooncake-synthetic the seats do (24 of 24 running at every preemption, free KV 95%),
so a free-KV column would read "95% free" as "safe" there. Checkpoints trained on other
columns are refused online (`check_trained_for` compares the names)."""

SCALE_FREE_DOCS: dict[str, str] = {
    "num_preemptions": FEATURE_DOCS["num_preemptions"],
    "pool_share": "KV blocks this request holds / all KV blocks",
    "slice_usage": FEATURE_DOCS["slice_usage"],
    "rank_share": "score_rank / (running requests - 1): 0 = the lowest score, the next victim",
    "sla_level": FEATURE_DOCS["sla_level"],
    "need_share": "KV blocks it still needs to reach max_tokens / free KV blocks (capped at 10)",
    "queue_share": "waiting requests (arrived by now, queued or not yet) that beat it by "
    "the trigger margin / max_num_seqs (a share of the batch's seats; capped at 10)",
    "headroom": "min(free KV blocks / all KV blocks, free seats / max_num_seqs): how far "
    "the batch is from refusing the queue's head (0: refused, a trigger can fire)",
}

FORECAST_NAMES: tuple[str, ...] = tuple(
    "forecast_lead" if name == "sla_level" else name for name in SCALE_FREE_NAMES
)
"""The `forecast` set: `scale_free` with `sla_level` replaced by what a fork of the engine
that knows only the present (preempt.early.lookahead, `knows_future=False`) says of the
request. The scheduler is deterministic, so until a request arrives or ends early the
fork's preemptions are the ones that happen (when collecting: online, the model's own
early saves shift stalls, so less exactly); what it cannot see (challengers yet to
arrive) is left to the model's other inputs and its memory. `sla_level` gave its slot:
the score that decides victims already counts it (`rank_share`, `queue_share`)."""

_FORECAST_LEAD = FORECAST_NAMES.index("forecast_lead")

FORECAST_DOCS: dict[str, str] = {
    **{name: SCALE_FREE_DOCS[name] for name in SCALE_FREE_NAMES if name != "sla_level"},
    "forecast_lead": "1 / (engine steps until the forecast's fork preempts it), 0 if the fork does "
    "not preempt it within the horizon (forked every FORECAST_EVERY_STEPS feature steps, and at once "
    "on an arrival or a finish before max_tokens)",
}

FORECAST_EVERY_STEPS = 4
"""The `forecast` set forks every this many feature steps (engine steps x the stride
`every_k_steps`) and at once on news. Part of the set's definition, and recorded nowhere
else: checkpoints are checked by feature names, so changing it means a new set name, or
old checkpoints would read another feature. (At stride 1, the cadence of `preempt bench
early`'s `forecast_k4` arm: 0.27 forks a step on azure-conv, docs/archive/predictor-history.md.)"""

FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "v1": FEATURE_NAMES,
    "scale_free": SCALE_FREE_NAMES,
    "forecast": FORECAST_NAMES,
}
"""Feature sets by name; a checkpoint records the one it was trained on, and the online
predictor refuses another."""
FEATURE_SET_DOCS: dict[str, dict[str, str]] = {
    "v1": FEATURE_DOCS,
    "scale_free": SCALE_FREE_DOCS,
    "forecast": FORECAST_DOCS,
}
_NEED_CAP = 10.0


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
    """The `scale_free` set (SCALE_FREE_NAMES), (R, 8) float32: shares of the pool, of
    the running requests and of the batch's seats.

    One pass of attribute reads, then numpy: the same values as computing the `v1`
    columns and rescaling them, without ~5 Python passes over the running requests and
    one `time_slice_s` call each (it runs every step, online)."""
    num_running = len(running)
    fields = np.array(
        [
            (
                r.arrival_s,
                r.sla_level,
                r.num_prompt_tokens,
                r.num_computed_tokens,
                r.max_tokens,
                len(r.output_token_ids),
                r.num_preemptions,
                r.slice_used_s,
                len(r.block_ids),
            )
            for r in running
        ],
        dtype=np.float64,
    ).reshape(num_running, 9)
    arrival, sla, prompt, computed, max_tokens, output, preemptions, slice_used, held = fields.T
    weights = preemption.priority_weights
    remaining = (np.maximum(prompt - computed, 0) + np.maximum(max_tokens - output, 0)) / 1000.0
    scores = age_terms(now, arrival, weights) + sla * weights.sla - remaining * weights.tokens
    bars = scores + preemption.threshold * np.maximum(np.abs(scores), preemption.score_floor)
    waiting_sorted = np.sort(waiting_scores)
    num_beating = len(waiting_sorted) - np.searchsorted(waiting_sorted, bars, side="right")
    rank = np.searchsorted(np.sort(scores), scores, side="left")  # strictly lower scores
    out = np.empty((num_running, NUM_FEATURES), dtype=np.float32)
    out[:, 0] = preemptions
    out[:, 1] = held.astype(np.float32) / num_blocks
    out[:, 2] = slice_used / _time_slices_s(prompt + output, preemption)
    out[:, 3] = rank.astype(np.float32) / max(1, num_running - 1)
    out[:, 4] = sla
    final_tokens = (prompt + max_tokens).astype(np.float32)
    need = np.maximum(0.0, np.ceil(final_tokens / block_size) - held.astype(np.float32))
    out[:, 5] = np.minimum(need / max(1, num_free_blocks), _NEED_CAP)
    out[:, 6] = np.minimum(num_beating.astype(np.float32) / max_num_seqs, _NEED_CAP)
    out[:, 7] = min(num_free_blocks / num_blocks, max(0, max_num_seqs - num_running) / max_num_seqs)
    return out


def _time_slices_s(num_tokens: np.ndarray, preemption: PreemptionConfig) -> np.ndarray:
    """`time_slice_s` of requests of these lengths, (R,) float64."""
    slices = preemption.time_slices
    if preemption.time_slice_strategy == "static":
        ms = np.full(len(num_tokens), slices.static_ms)
    else:
        ms = np.where(
            num_tokens > slices.long_above_tokens,
            slices.long_ms,
            np.where(num_tokens < slices.short_below_tokens, slices.short_ms, slices.medium_ms),
        )
    return np.maximum(ms, preemption.min_time_slice_ms) / 1000.0


def engine_features(view: EngineView, feature_set: str = "v1") -> np.ndarray:
    """The features (`feature_set`) of the engine's running requests now, (R, 8): what
    the feature logger records and what the early-save policies decide on."""
    now = view.now
    waiting = view.waiting_scores(now)
    if feature_set == "scale_free":
        # Requests that arrived during the step are not queued before the next schedule(),
        # which then preempts for them: on mooncake-synthetic (24 ms steps) every
        # challenger arrived < 20 ms before its preemption, so a queue read without them
        # saw no challenger at any preemption. They have arrived (a server holds them):
        # present state, not the future. (`v1` keeps its old reading: a contract with
        # its checkpoints.)
        arrived = view.upcoming_arrivals(now)
        if arrived:
            waiting = np.concatenate(
                [waiting, priority_scores(arrived, now, view.config.preemption.priority_weights)]
            )
        args = (view.running, waiting, now, view.num_free_blocks, view.num_blocks)
        return scale_free_features(*args, view.block_size, view.max_num_seqs, view.config.preemption)
    args = (view.running, waiting, now, view.num_free_blocks, view.num_blocks)
    return compute_features(*args, view.config.preemption)


class Features:
    """The features (`feature_set`) of one engine's running requests, step after step: what
    the feature logger records and what the `lstm` early-save policy decides on. The
    `v1` and `scale_free` sets read the view alone (`engine_features`); `forecast` also
    keeps a fork's forecast current (`RollingForecast`, over the labels' horizon), so one
    instance serves one run. Virtual clock only for `forecast` (a fork cannot replay
    real time)."""

    def __init__(self, feature_set: str = "v1", horizon_ms: float = 50.0, horizon_steps: int = 0) -> None:
        if feature_set not in FEATURE_SETS:
            raise ValueError(f"feature_set must be one of {sorted(FEATURE_SETS)}, got '{feature_set}'")
        self.feature_set = feature_set
        self.rolling: RollingForecast | None = None
        if feature_set == "forecast":
            from preempt.early.lookahead import Lookahead, RollingForecast

            lookahead = Lookahead(horizon_ms, horizon_steps, knows_future=False)
            self.rolling = RollingForecast(lookahead, FORECAST_EVERY_STEPS)

    def __call__(self, view: EngineView) -> np.ndarray:
        """(R, 8) float32 for `view.running`, in FEATURE_SETS[feature_set] order."""
        if self.rolling is None:
            return engine_features(view, self.feature_set)
        out = engine_features(view, "scale_free")
        self.rolling.update(view)
        num_steps = view.num_steps
        for row, request in enumerate(view.running):
            steps = self.rolling.steps_until(request.request_id, num_steps)
            out[row, _FORECAST_LEAD] = 0.0 if steps is None else 1.0 / steps
        return out

    def note_finished(self, requests: Sequence[Request]) -> None:
        """These requests left for good (finished or aborted): news for the forecast."""
        if self.rolling is not None:
            self.rolling.note_finished(requests)
