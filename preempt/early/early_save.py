"""Early (speculative) KV saves: whom to copy to the host before a preemption happens.

Owns: the policies, chosen by name (`early_save.policy`), and `EarlySaver`, the engine
hook that after every step that ran something asks the policy which running requests to
save early and hands them to the saver (which acts: snapshots their full blocks in the
background; a later preemption then copies only the blocks written since, a finish
discards the copy). Deciding code: plain Python and numpy; only the `lstm` policy's
predictor holds tensors.

Policies (each returns the running requests to save now; the saver skips those with no
new full block, and refuses beyond its speculation budget and in-flight bound):
- `always`: every running request (write-through, as SGLang's HiCache backs up KV).
- `rule`: the scheduler's own next victim: among requests whose time slice is used up,
  the one with the lowest priority score (the `rule` baseline of predictor/), when
  a waiting request outranks it or free KV runs low.
- `lstm`: the trained predictor (`preempt.early.online_predictor.OnlinePredictor`): one LSTM step per
  engine step over all running requests in one batch, carrying each request's state;
  saves where p >= threshold. With `early_save.waste_cap`, `WasteCap` moves the threshold
  online to hold the live share of early bytes wasted at the cap.
- `oracle`: knows the future from a reference run of the same config without early
  saves (its preemptions.parquet): saves a request `horizon_ms` before its next
  preemption there. Not an upper bound: once early saves shift the live timeline, the
  reference run's preemptions drift away from the live ones (kept for comparison).
- `lookahead`: the true future: every `lookahead_every_steps` steps it forks the engine
  and simulates the current policy ahead over the horizon (preempt.early.lookahead), and saves
  the running requests the fork preempts within it. Measured in the same run as the
  predictors; the upper bound of what a predictor can warn about.
- `forecast`: the same fork knowing only the present (no request that has not arrived;
  every request runs to its `max_tokens`): a model-based predictor reading only what a
  server knows (virtual clock only, like the oracle; not a bound). It forks every
  `lookahead_every_steps` steps, and at once on news the last fork could not know (an
  arrival; a request ending before its max_tokens).
- `projection`: the forecast without a fork (preempt.early.projection): the scheduler's
  block arithmetic and preemption rules stepped ahead from the present state, every step,
  at a tenth of a fork's host time; on any clock. With a learned output-length model
  (`early_save.length_model`) it keeps a predicted preemption only as many steps ahead
  as no unforeseen finish is likely (a finish frees what the preemption needed).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from preempt.core.config import ConfigError, EarlySaveConfig
from preempt.core.registry import EARLY_SAVE_POLICIES
from preempt.core.request import Request
from preempt.early.features import FEATURE_NAMES, Features
from preempt.kv.record import is_preemption

if TYPE_CHECKING:
    from preempt.early.lookahead import Lookahead
    from preempt.engine.lengths import LengthModel
    from preempt.engine.view import EngineView, StepOutput

# The rule fires when free KV falls under this share (a memory preemption is near).
_RULE_FREE_KV = 0.05


class EarlySavePolicy(ABC):
    """Picks running requests to save early. `features` is (R, 8) for `running`, computed
    once per step by the hook from the policy's own `features` source (None: the policy
    reads none, and is passed None)."""

    features: Features | None = None

    @classmethod
    def from_config(cls, config: EarlySaveConfig) -> EarlySavePolicy:
        """The policy `early_save` asks for (a user's subclass may read any of its keys)."""
        return cls()

    @property
    def lookahead(self) -> Lookahead | None:
        """The engine fork this policy pays for, if any (its cost goes into the stats):
        by default the `forecast` feature set's."""
        source = self.features
        return source.rolling.lookahead if source is not None and source.rolling is not None else None

    @abstractmethod
    def select(
        self, running: Sequence[Request], features: np.ndarray | None, now: float
    ) -> list[Request]: ...

    def forget(self, requests: Sequence[Request]) -> None:  # noqa: B027 (optional hook)
        """These requests left the batch for good (finished or aborted)."""

    def prepare(self, view: EngineView) -> None:  # noqa: B027 (optional hook)
        """Called before `select` each step with the engine's view (the lookahead oracle
        forks it; nobody changes it)."""


class AlwaysPolicy(EarlySavePolicy):
    def select(self, running: Sequence[Request], features: np.ndarray | None, now: float) -> list[Request]:
        return list(running)


class RulePolicy(EarlySavePolicy):
    def __init__(self) -> None:
        self.features = Features("v1")

    def select(self, running: Sequence[Request], features: np.ndarray, now: float) -> list[Request]:
        column = {name: i for i, name in enumerate(FEATURE_NAMES)}
        candidates = np.flatnonzero(features[:, column["slice_usage"]] >= 1.0)
        if candidates.size == 0:
            return []
        victim = int(candidates[np.argmin(features[candidates, column["score_rank"]])])
        pressed = features[victim, column["queue_pressure"]] > 0
        low_memory = features[victim, column["free_kv_fraction"]] < _RULE_FREE_KV
        return [running[victim]] if pressed or low_memory else []


class LSTMPolicy(EarlySavePolicy):
    @classmethod
    def from_config(cls, config: EarlySaveConfig) -> LSTMPolicy:
        return cls(config)

    def __init__(self, config: EarlySaveConfig) -> None:
        from preempt.early.online_predictor import (  # torch, only when asked for
            OnlinePredictor,
            check_trained_for,
        )

        checkpoint = config.checkpoint
        try:
            self.predictor = OnlinePredictor.from_checkpoint(checkpoint, threshold=config.threshold)
            check_trained_for(
                checkpoint,
                self.predictor.hparams,
                config.horizon_ms,
                config.horizon_steps,
                config.feature_set,
                config.every_k_steps,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config key 'early_save.checkpoint': {exc}") from None
        self.features = Features(config.feature_set, config.horizon_ms, config.horizon_steps)
        # A model trained on rows logged every k steps takes one LSTM step per k engine
        # steps (checked above: early_save.every_k_steps = the checkpoint's k); between,
        # the last decision stands.
        self.every_k_steps = config.every_k_steps
        self.waste_cap = None
        if config.waste_cap is not None:
            if not np.isfinite(self.predictor.threshold):
                raise ConfigError(
                    "config key 'early_save.waste_cap': the controller starts from the threshold, and "
                    f"{checkpoint}'s is {self.predictor.threshold} (it never warns); set early_save.threshold"
                )
            self.waste_cap = WasteCap(self.predictor.threshold, config.waste_cap, config.waste_cap_gain)
        self._stepping = True
        self._chosen: set[int] = set()
        self.last_probs: np.ndarray = np.zeros(0, dtype=np.float32)

    def prepare(self, view: EngineView) -> None:
        # The steps preempt.obs.dataset.FeatureLogger logs a row at, so online = offline.
        self._stepping = view.num_steps % self.every_k_steps == 0
        if self.waste_cap is not None:
            self.waste_cap.update(*view.early_bytes_resolved)

    @property
    def threshold(self) -> float:
        return self.predictor.threshold if self.waste_cap is None else self.waste_cap.threshold

    @property
    def needs_features_now(self) -> bool:
        return self._stepping

    def select(self, running: Sequence[Request], features: np.ndarray | None, now: float) -> list[Request]:
        if self._stepping:
            ids = [r.request_id for r in running]
            probs = self.predictor.step(ids, features)
            self.last_probs = probs
            threshold = self.threshold
            self._chosen = {rid for rid, p in zip(ids, probs, strict=True) if p >= threshold}
        return [r for r in running if r.request_id in self._chosen]

    def forget(self, requests: Sequence[Request]) -> None:
        self.predictor.forget(r.request_id for r in requests)
        self.features.note_finished(requests)


class WasteCap:
    """Holds the live share of early-copied bytes wasted near `cap` by moving the `lstm`
    policy's threshold: integral control, in logit space, on the recent waste share.

    Why: the threshold is chosen on val, whose load the live trace need not share. Where
    preemptions are rarer (a lighter window), more warned requests finish instead, and the
    same threshold wastes more (measurements: docs/archive/predictor-history.md). Waste is
    observed online only when an early copy's
    fate is known (claimed by a preemption, or freed unclaimed), so the controller reads
    those totals each step: with U, W the claimed and wasted bytes since the start,
    exponentially forgotten per step in which some resolved (`MEMORY`), the logit of the
    threshold moves by gain * (W / (U + W) - cap). It starts at the checkpoint's (or
    `early_save.threshold`'s) threshold and stays within `MAX_SHIFT` logits of it.
    Deterministic: it reads only the engine's own counters."""

    MEMORY = 0.98
    """Per resolved step: the weight left on older outcomes (~50 resolved steps)."""
    MAX_SHIFT = 4.0
    """Logits the threshold may move either way from where it started."""

    def __init__(self, threshold: float, cap: float, gain: float) -> None:
        self.cap = cap
        self.gain = gain
        self._start = _logit(threshold)
        self._logit = self._start
        self._used = 0
        self._wasted = 0
        self._recent_used = 0.0
        self._recent_wasted = 0.0

    @property
    def threshold(self) -> float:
        return float(1.0 / (1.0 + np.exp(-self._logit)))

    @property
    def recent_waste_share(self) -> float | None:
        total = self._recent_used + self._recent_wasted
        return self._recent_wasted / total if total > 0 else None

    def update(self, used_total: int, wasted_total: int) -> None:
        """The saver's totals of early bytes claimed and wasted so far (never decrease)."""
        used, wasted = used_total - self._used, wasted_total - self._wasted
        if used <= 0 and wasted <= 0:
            return
        self._used, self._wasted = used_total, wasted_total
        self._recent_used = self.MEMORY * self._recent_used + used
        self._recent_wasted = self.MEMORY * self._recent_wasted + wasted
        error = self.recent_waste_share - self.cap
        shifted = self._logit + self.gain * error
        self._logit = min(max(shifted, self._start - self.MAX_SHIFT), self._start + self.MAX_SHIFT)


def _logit(p: float) -> float:
    p = min(max(p, 1e-9), 1 - 1e-9)
    return float(np.log(p / (1 - p)))


class OraclePolicy(EarlySavePolicy):
    @classmethod
    def from_config(cls, config: EarlySaveConfig) -> OraclePolicy:
        return cls(config.oracle_log, config.horizon_ms)

    def __init__(self, oracle_log: str, horizon_ms: float) -> None:
        self.events = load_preemption_times(oracle_log)
        self.horizon_s = horizon_ms / 1000.0

    def select(self, running: Sequence[Request], features: np.ndarray | None, now: float) -> list[Request]:
        chosen = []
        for request in running:
            times = self.events.get(request.request_id)
            if times is None:
                continue
            i = int(np.searchsorted(times, now, side="left"))
            if i < len(times) and times[i] - now <= self.horizon_s:
                chosen.append(request)
        return chosen


class LookaheadPolicy(EarlySavePolicy):
    knows_future = True  # the fork sees the requests that have not arrived yet

    @classmethod
    def from_config(cls, config: EarlySaveConfig) -> LookaheadPolicy:
        return cls(config.horizon_ms, config.horizon_steps, config.lookahead_every_steps, cls.knows_future)

    def __init__(
        self, horizon_ms: float, horizon_steps: int, every_steps: int = 1, knows_future: bool = True
    ) -> None:
        from preempt.early.lookahead import Lookahead, RollingForecast

        self.rolling = RollingForecast(Lookahead(horizon_ms, horizon_steps, knows_future), every_steps)

    @property
    def lookahead(self) -> Lookahead:
        return self.rolling.lookahead

    def forget(self, requests: Sequence[Request]) -> None:
        self.rolling.note_finished(requests)

    def prepare(self, view: EngineView) -> None:
        self.rolling.update(view)

    def select(self, running: Sequence[Request], features: np.ndarray | None, now: float) -> list[Request]:
        chosen = self.rolling.chosen
        return [r for r in running if r.request_id in chosen]


class ForecastPolicy(LookaheadPolicy):
    """The fork knowing only the present (requests arrived by now, each run to max_tokens)."""

    knows_future = False


class ProjectionPolicy(EarlySavePolicy):
    """The cheap forecast (preempt.early.projection), projected again every step. With a
    learned output-length model (preempt.engine.lengths), a predicted preemption is kept
    only within the steps the model trusts the projection for (`confident_steps`)."""

    @classmethod
    def from_config(cls, config: EarlySaveConfig) -> ProjectionPolicy:
        lengths = None
        if config.length_model is not None:
            from preempt.engine.lengths import LengthModel

            try:
                lengths = LengthModel.load(config.length_model)
            except ValueError as exc:
                raise ConfigError(f"config key 'early_save.length_model': {exc}") from None
        return cls(config.horizon_ms, config.horizon_steps, lengths, config.length_confidence)

    def __init__(
        self,
        horizon_ms: float,
        horizon_steps: int,
        lengths: LengthModel | None = None,
        confidence: float = 0.5,
    ) -> None:
        from preempt.early.projection import Projection

        self.projection = Projection(horizon_ms, horizon_steps)
        self.lengths = lengths
        self.budget = -math.log(confidence)  # expected unforeseen ends a kept prediction allows
        self.chosen: set[int] = set()
        self._last_now: float | None = None

    def prepare(self, view: EngineView) -> None:
        # the last step's length: the wall clock's estimate of the next (the virtual
        # clock's cost model is used where there is one)
        now = view.now
        step_s = now - self._last_now if self._last_now is not None else 0.0
        self._last_now = now
        forecast = self.projection.forecast(view, step_s)
        chosen = self.projection.within(forecast)
        if chosen and self.lengths is not None:
            furthest = max(forecast.preempted[rid][1] for rid in chosen)
            trusted = self.lengths.confident_steps(view.running, self.budget, furthest)
            chosen = {rid for rid in chosen if forecast.preempted[rid][1] <= trusted}
        self.chosen = chosen

    def select(self, running: Sequence[Request], features: np.ndarray | None, now: float) -> list[Request]:
        return [r for r in running if r.request_id in self.chosen]


def load_preemption_times(path: str) -> dict[int, np.ndarray]:
    """request_id -> sorted times it was taken out of the batch, from a preemptions.parquet
    (the same events the predictor's labels use: preempt.obs.dataset.preemption_events)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["time_s", "request_id", "reason", "action"]).to_pydict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key 'early_save.oracle_log': cannot read {path}: {exc}") from None
    events: dict[int, list[float]] = {}
    for time_s, request_id, reason, action in zip(
        table["time_s"], table["request_id"], table["reason"], table["action"], strict=True
    ):
        if is_preemption(reason, action):
            events.setdefault(request_id, []).append(time_s)
    return {rid: np.sort(np.asarray(times)) for rid, times in events.items()}


def make_policy(config: EarlySaveConfig) -> EarlySavePolicy | None:
    """The policy of `early_save.policy` (preempt.core.registry.EARLY_SAVE_POLICIES, or an
    import path); None for `none`."""
    try:
        policy_cls = EARLY_SAVE_POLICIES.resolve(config.policy)
    except ValueError as exc:
        raise ConfigError(f"config key 'early_save.policy': {exc}") from None
    if policy_cls is None:
        return None
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, EarlySavePolicy)):
        raise ConfigError(
            f"config key 'early_save.policy': '{config.policy}' is not a "
            "preempt.early.early_save.EarlySavePolicy subclass"
        )
    return policy_cls.from_config(config)


class EarlySaver:
    """`hook(view, output)` after each engine step: forget finished requests (their
    early copies were wasted), then save early whom the policy picks."""

    def __init__(self, policy: EarlySavePolicy) -> None:
        self.policy = policy
        self.num_selected = 0  # picks, including those the saver skipped (nothing new, budget)
        # The last step's picks (ids) and that step's number, for a measuring probe
        # (preempt.bench.early) that tells "never warned" from "warned, refused".
        self.chosen_ids: frozenset[int] = frozenset()
        self.chosen_step = -1

    def __call__(self, view: EngineView, output: StepOutput) -> None:
        if output.finished:
            self.policy.forget(output.finished)
            for request in output.finished:
                view.discard_early(request)
        running = view.running
        if not output.scheduled.chunks or not running:
            return
        now = view.now
        self.policy.prepare(view)
        policy = self.policy
        source = policy.features
        needs = source is not None and getattr(policy, "needs_features_now", True)
        features = source(view) if needs else None
        chosen = self.policy.select(running, features, now)
        self.num_selected += len(chosen)
        self.chosen_ids = frozenset(request.request_id for request in chosen)
        self.chosen_step = view.num_steps
        for request in chosen:
            view.early_save(request)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"early_save_selected": self.num_selected}
        projection = getattr(self.policy, "projection", None)
        if projection is not None:  # what the projection costs (wall time: not reproducible)
            stats |= {"projection_calls": projection.num_calls, "projection_wall_s": projection.wall_s}
        lookahead = self.policy.lookahead
        if lookahead is not None:  # what the fork costs: forks, steps simulated, wall time
            stats |= {
                "lookahead_forks": lookahead.num_forks,
                "lookahead_fork_steps": lookahead.num_fork_steps,
                "lookahead_wall_s": lookahead.wall_s,  # wall time: not reproducible
            }
        return stats


def build_early_saver(config: EarlySaveConfig) -> EarlySaver:
    """The engine's early-save hook for `config` (preempt.core.registry.STEP_HOOKS)."""
    return EarlySaver(make_policy(config))
