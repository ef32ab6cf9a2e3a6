"""How much output a request still has to make, as the scheduler estimates it: the
remaining-work term of the design's score (preempt.engine.priority) and the order of the
length-aware baseline (`srpt`, preempt.engine.policies).

Chosen by `preemption.remaining`:
- `max_tokens`: what the server is told, the output still allowed by the client's cap
  (the estimate every server has; vLLM, SGLang and FastServe read nothing finer).
- `learned`: the conditional expected output still to come given the prompt length, the
  cap and the tokens generated so far (preempt.engine.lengths.LengthModel), re-estimated
  after every generated token, as Trail (Shahout et al., ICLR 2025) refines its estimate
  as a request runs. The model is `preemption.length_model` (a `preempt lengths` file), or
  fitted from the trace's own records outside the replayed window: what a server that
  served the rest of the trace would have logged, never the requests being judged.
- `oracle`: the true output length (an upper bound for what length knowledge is worth;
  every arm that uses it is labelled oracle).

The estimate lives on the request (`Request.expected_output_left`, None under
`max_tokens`, which reads the cap directly), set by the scheduler when a request joins
the queue and after each token: policies read it as they read any request field.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from preempt.core.config import ConfigError
from preempt.core.request import Request

if TYPE_CHECKING:
    from preempt.core.config import EngineConfig
    from preempt.engine.lengths import LengthModel


class RemainingEstimator(ABC):
    """Sets `request.expected_output_left` from what it knows."""

    @abstractmethod
    def estimate(self, request: Request) -> float:
        """Output tokens `request` is expected still to make (>= 0)."""

    def update(self, request: Request) -> None:
        request.expected_output_left = self.estimate(request)

    def __deepcopy__(self, memo: dict[int, object]) -> RemainingEstimator:
        return self  # its model is read, never written: a copy of the engine shares it


class OracleRemaining(RemainingEstimator):
    """The truth: the trace's output length (or the cap, if it comes first)."""

    def estimate(self, request: Request) -> float:
        return float(max(request.output_limit - request.num_output_tokens, 0))


class LearnedRemaining(RemainingEstimator):
    """E[remaining output | prompt length, max_tokens, tokens generated] under a fitted
    output-length model."""

    def __init__(self, model: LengthModel) -> None:
        self.model = model

    def estimate(self, request: Request) -> float:
        return self.model.expected_output_left(
            request.num_prompt_tokens, request.max_tokens, request.num_output_tokens
        )


def make_estimator(config: EngineConfig) -> RemainingEstimator | None:
    """The estimator `preemption.remaining` names; None for `max_tokens` (nothing to set)."""
    preemption = config.preemption
    if preemption.remaining == "max_tokens":
        return None
    if preemption.remaining == "oracle":
        return OracleRemaining()
    from preempt.engine.lengths import LengthModel

    if preemption.length_model is not None:
        try:
            return LearnedRemaining(LengthModel.load(preemption.length_model))
        except ValueError as exc:
            raise ConfigError(f"config key 'preemption.length_model': {exc}") from None
    return LearnedRemaining(_fit_outside_window(config))


_FITTED: dict[tuple, LengthModel] = {}  # a sweep builds many engines on one window


def _fit_outside_window(config: EngineConfig) -> LengthModel:
    """A length model from the trace's records outside the window this run replays."""
    from preempt.engine.lengths import LengthModel

    workload = config.workload
    start = workload.start_s
    end = float("inf") if workload.duration_s is None else start + workload.duration_s
    key = (
        workload.trace,
        workload.max_tokens_mode,
        workload.max_tokens_fixed,
        workload.max_tokens_noise,
        config.seed,
        start,
        end,
    )
    if key not in _FITTED:
        if len(_FITTED) > 64:
            _FITTED.clear()
        try:
            _FITTED[key] = LengthModel.from_trace(workload, config.seed, (start, end))
        except ValueError as exc:
            raise ConfigError(
                f"config key 'preemption.remaining': learned lengths need requests outside the "
                f"replayed window of trace '{workload.trace}' to fit on ({exc}); give "
                f"preemption.length_model (`preempt lengths`)"
            ) from None
    return _FITTED[key]
