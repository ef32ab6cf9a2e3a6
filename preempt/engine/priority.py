"""The design's priority score, its trigger margin, and time slices.

Owns: the arithmetic of "who is more important, by enough, and has the incumbent had its
turn". Plain Python over request fields a real server knows; never reads the future
(`target_output_tokens`; the `oracle` estimator of preempt.engine.remaining does, labelled)
and never mutates a request.

Score (units are part of the definition, see PriorityWeights):
    score = age_s * w_age + sla_level * w_sla - remaining_ktokens * w_tokens
with age_s capped at `age_cap_s` when the weights set one.
Trigger: a challenger beats an incumbent when
    score_c - score_i > threshold * max(|score_i|, score_floor)
A relative margin alone breaks down around zero (any epsilon beats 0 by "20%") and flips
for negative scores (20% of a negative number lowers the bar); measuring the margin on
|score_i|, floored at score_floor, keeps it a positive, scale-aware hurdle for every sign.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from preempt.core.config import PreemptionConfig, PriorityWeights
from preempt.core.request import Request


def output_left(request: Request) -> float:
    """Output tokens the scheduler expects `request` still to make: its estimator's
    (`preemption.remaining`, preempt.engine.remaining) or, by default, what `max_tokens`
    still allows (the estimate a server has, not the truth)."""
    if request.expected_output_left is not None:
        return request.expected_output_left
    return max(request.max_tokens - request.num_output_tokens, 0)


def remaining_ktokens(request: Request) -> float:
    """Estimated remaining work in thousands of tokens: prompt not yet prefilled plus the
    output still expected (`output_left`)."""
    prefill_left = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
    return (prefill_left + output_left(request)) / 1000.0


def priority_score(request: Request, now: float, weights: PriorityWeights) -> float:
    age = now - request.arrival_s
    if weights.age_cap_s is not None:
        age = min(age, weights.age_cap_s)
    return age * weights.age + request.sla_level * weights.sla - remaining_ktokens(request) * weights.tokens


def age_terms(now: float, arrival: np.ndarray, weights: PriorityWeights) -> np.ndarray:
    """The score's age term for many arrivals at once (capped at `age_cap_s` when set)."""
    age = now - arrival
    if weights.age_cap_s is not None:
        age = np.minimum(age, weights.age_cap_s)
    return age * weights.age


def priority_scores(requests: Sequence[Request], now: float, weights: PriorityWeights) -> np.ndarray:
    """`priority_score` of many requests at once, (N,) float64: one pass of attribute
    reads, then numpy (the feature logger scores thousands of waiting requests a step)."""
    fields = np.array(
        [
            (r.arrival_s, r.sla_level, r.num_prompt_tokens, r.num_computed_tokens, output_left(r))
            for r in requests
        ],
        dtype=np.float64,
    ).reshape(len(requests), 5)
    arrival, sla, prompt, computed, decode_left = fields.T
    remaining = (np.maximum(prompt - computed, 0) + decode_left) / 1000.0
    return age_terms(now, arrival, weights) + sla * weights.sla - remaining * weights.tokens


def beats(challenger_score: float, incumbent_score: float, threshold: float, floor: float) -> bool:
    return challenger_score - incumbent_score > threshold * max(abs(incumbent_score), floor)


def time_slice_s(request: Request, config: PreemptionConfig) -> float:
    """The slice a running request may use before it can be preempted for priority.
    `dynamic`: by its current length class; `static`: one slice for all."""
    slices = config.time_slices
    if config.time_slice_strategy == "static":
        ms = slices.static_ms
    elif request.num_tokens > slices.long_above_tokens:
        ms = slices.long_ms
    elif request.num_tokens < slices.short_below_tokens:
        ms = slices.short_ms
    else:
        ms = slices.medium_ms
    return max(ms, config.min_time_slice_ms) / 1000.0
