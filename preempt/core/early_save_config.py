"""The `early_save` section: speculative KV saves before a preemption and restores ahead
of admission (what preempt.early reads)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from preempt.core.config_base import Section
from preempt.core.registry import EARLY_SAVE_POLICIES


class EarlySaveConfig(Section):
    """Speculative KV saves before a preemption happens: when the
    policy expects a running request to be preempted soon, its blocks are copied to the
    host in the background; the preemption then saves only the blocks written since."""

    policy: str = "none"
    """A name of `preempt.core.registry.EARLY_SAVE_POLICIES`, or the import path of a
    user's own `EarlySavePolicy` subclass. `always`: every running request (write-through,
    like SGLang HiCache); `rule`: the lowest-priority running request whose time slice is
    used up; `lstm`: the trained predictor (`checkpoint`) at p >= threshold; `oracle`: the
    preemptions of a reference run without early saves (`oracle_log`), within
    `horizon_ms`; `lookahead`: the true future, by simulating a fork of the engine ahead
    (preempt/early/lookahead.py; virtual clock); `forecast`: the same fork knowing only
    the present (requests arrived by now, each run to its `max_tokens`); `projection`: the
    forecast without a fork, the scheduler's block arithmetic stepped ahead from the
    present state (preempt/early/projection.py; any clock), every step, with
    `length_model` if given (docs/predictor.md: the recommended policy)."""
    checkpoint: str | None = None
    """`lstm`: the predictor checkpoint (`preempt train` writes predictor.ckpt)."""
    threshold: float | None = Field(None, gt=0, lt=1)
    """`lstm`: probability that starts an early save (None: the checkpoint's own
    operating threshold)."""
    waste_cap: float | None = Field(None, gt=0, lt=1)
    """`lstm`: hold the live share of early-copied bytes that are wasted at this value by
    moving the threshold online (`preempt.early.early_save.WasteCap`: integral control
    on the recent waste share, from `threshold`). A threshold chosen on val drifts
    when the load shifts (fewer preemptions, more finishes per warning); this follows it.
    None: the threshold stays fixed."""
    waste_cap_gain: float = Field(0.2, gt=0)
    """`waste_cap`: logit units the threshold moves per step in which early copies were
    claimed or wasted, per unit of error in the recent waste share (the default's choice on
    dev windows: docs/archive/predictor-history.md)."""
    oracle_log: str | None = None
    """`oracle`: preemptions.parquet of a run with the same config and early_save none."""
    horizon_ms: float = Field(50.0, gt=0)
    """`oracle`/`lookahead`/`lstm`: how far ahead a preemption counts as predicted (a
    `lstm` checkpoint must have been trained with the same horizon)."""
    horizon_steps: int = Field(0, ge=0)
    """The horizon in engine steps as well: predicted when within `horizon_ms` or within
    this many steps, whichever reaches further (0: time only)."""
    feature_set: Literal["v1", "scale_free", "forecast"] = "v1"
    """`lstm`: the features the checkpoint must have been trained on (preempt.early.features;
    `forecast` forks the engine, so virtual clock only)."""
    every_k_steps: int = Field(1, gt=0)
    """`lstm`: step the predictor (features and LSTM) every this many engine steps, keeping
    its decision between; the checkpoint must have been trained on rows logged at the same
    stride (`features.every_k_steps`), or it is refused."""
    lookahead_every_steps: int = Field(1, gt=0)
    """`lookahead`/`forecast`: fork and simulate every this many steps (between, reuse the
    forecast). `forecast` also forks at once on news its last fork could not know (an
    arrival; a request ending before its max_tokens)."""
    length_model: str | None = None
    """`projection`: a learned output-length model (`preempt lengths fit` writes
    lengths.json; preempt.engine.lengths). The projection runs every request to its
    max_tokens; with this model it keeps only the preemptions it predicts within the
    steps where no unforeseen finish is likely (`length_confidence`): a request ending
    early frees the seat or blocks the predicted preemption needed. None: all kept."""
    length_confidence: float = Field(0.5, gt=0, lt=1)
    """`length_model`: the probability, under the model, that no running request ends
    before a predicted preemption's step, that keeping the prediction needs."""
    prefetch: bool = False
    """Restore prefetch (preempt/early/prefetch.py): start restoring the next requests to be
    admitted into free blocks before they are admitted (virtual clock)."""
    prefetch_depth: int = Field(8, gt=0)
    """Prefetch: how many of the next requests to be admitted are considered."""
    prefetch_block_share: float = Field(0.25, gt=0, le=1)
    """Prefetch: at most this share of the KV blocks held by prefetched restores."""
    prefetch_host_budget: int | str = Field("8GB", validate_default=True)
    """Prefetch: host bytes that copies decoded ahead of their restore may hold at once."""
    prefetch_decode_threads: int = Field(4, gt=0)
    """Prefetch: host threads decoding ahead, one blob each at the codec's calibrated
    per-thread rate (`clock.codecs.<name>.decode_mb_s`)."""
    host_budget: int | str = Field("1GB", validate_default=True)
    """Host bytes that speculative copies may hold at once; demand saves always come first."""
    max_inflight: int = Field(4, gt=0)
    """Early saves queued or running at once (the bounded queue)."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        return EARLY_SAVE_POLICIES.check(name)

    @field_validator("host_budget", "prefetch_host_budget")
    @classmethod
    def _size(cls, value: int | str) -> int:
        from preempt.core.sizes import parse_size

        return parse_size(value)

    @model_validator(mode="after")
    def _needs(self) -> EarlySaveConfig:
        if self.policy == "lstm" and not self.checkpoint:
            raise ValueError("policy 'lstm' needs early_save.checkpoint (a predictor.ckpt)")
        if self.waste_cap is not None and self.policy != "lstm":
            raise ValueError(
                f"early_save.waste_cap moves the lstm policy's threshold; policy is '{self.policy}'"
            )
        if self.length_model is not None and self.policy != "projection":
            raise ValueError(
                f"early_save.length_model informs the projection policy; policy is '{self.policy}'"
            )
        if self.policy == "oracle" and not self.oracle_log:
            raise ValueError("policy 'oracle' needs early_save.oracle_log (a reference preemptions.parquet)")
        return self
