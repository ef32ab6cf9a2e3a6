"""Frozen, validated configuration for every layer of the engine.

Owns: the schema (one section per layer), loading from JSON/YAML, `--set key=value`
overrides, and error messages that name the offending key. Runtime facts (the number of
blocks actually allocated, the model's vocabulary) live in state objects, never here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from preempt.core.registry import (
    EARLY_SAVE_POLICIES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    check_mode,
    check_reclaim_codec,
)


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __deepcopy__(self, memo: dict[int, object] | None = None) -> _Section:
        return self  # frozen: a copy of the engine shares its config, as a tuple would


class ModelConfig(_Section):
    backend: Literal["tiny", "null", "hf"] = "tiny"
    """`tiny`: real small Llama-style decoder on CPU; `null`: no model compute; `hf`: a
    Llama/Qwen2-family checkpoint (config.json + safetensors) from `checkpoint`."""

    @field_validator("backend", mode="before")
    @classmethod
    def _yaml_null_is_the_null_backend(cls, value: Any) -> Any:
        # YAML (and so `--set model.backend=null`) reads a bare `null` as None.
        return "null" if value is None else value

    preset: str = "tiny-2l"
    """Architecture preset of the `tiny` backend (see preempt.model.tiny.PRESETS)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Compute and KV dtype. Tests use float64 so batching can never flip a greedy argmax."""
    num_threads: int | None = Field(None, gt=0)
    """torch intra-op threads for the model (None: torch's default, one per core). On CPU
    with the wall clock, leave a core to the save worker: OpenMP threads that find their
    core taken stall at every barrier (measured by `preempt bench save`)."""
    max_model_len: int = Field(16384, gt=0)
    """Longest prompt + output a request may have; longer ones end ABORTED(prompt_too_long)."""
    checkpoint: str | None = None
    """Trained weights. `tiny`: a file written by `preempt lm train` (its architecture
    replaces `preset`); `hf`: a local directory with config.json + *.safetensors.
    None with `tiny`: the preset's seeded random weights."""

    @model_validator(mode="after")
    def _hf_needs_a_checkpoint(self) -> ModelConfig:
        if self.backend == "hf" and not self.checkpoint:
            raise ValueError("backend 'hf' needs model.checkpoint: a local checkpoint directory")
        return self


class CacheConfig(_Section):
    block_size: int = Field(16, gt=0)
    """Tokens per KV block."""
    num_blocks: int | None = Field(None, gt=0)
    """Usable blocks in the pool. None: the target's KV capacity (clock.target) less the one
    block vLLM keeps as its null block (so `num_blocks` here is vLLM's `num_gpu_blocks` - 1)."""


class SglangConfig(_Section):
    """The `sglang_*` policies' own knobs, named and defaulted as SGLang 0.5.23's server
    arguments (python/sglang/srt/arg_groups/fields/schedule.py and environ.py)."""

    chunked_prefill_size: int | None = Field(None, gt=0)
    """Tokens of one prefill chunk. None: `scheduler.max_num_batched_tokens`, so every
    policy gets the same step budget (SGLang's own default on an H100/H200 is 8192)."""
    max_prefill_tokens: int | None = Field(None, gt=0)
    """Tokens one prefill batch may hold. None: `scheduler.max_num_batched_tokens`
    (SGLang's default is 16384)."""
    schedule_conservativeness: float = Field(1.0, gt=0)
    """Scales the initial new-token ratio (0.7 x this, capped at 1)."""
    priority_preemption_threshold: int = Field(0, ge=0)
    """`sglang_priority`: a waiting request preempts a running one only when its level
    exceeds the victim's by MORE than this (SGLang's
    --priority-scheduling-preemption-threshold, strict, default 10 on a priority scale of
    the user's choosing; SLA levels here are 0-2, so 0: any higher level)."""


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(128, gt=0)
    """Most requests in one batch."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """Token budget of one step (decode tokens + prefill chunks)."""
    policy: str = "vllm_fcfs"
    """Victim/admission policy: a name of `preempt.core.registry.SCHEDULING_POLICIES`, or
    the import path of a user's own `SchedulingPolicy` subclass (`my_module:MyPolicy`)."""
    reserve_full_sequence: bool = True
    """Admit a waiting (or preempted) request only when blocks for its whole current
    sequence (prompt + tokens generated so far) are free, although blocks are still
    allocated chunk by chunk. Mirrors vLLM 0.32's `scheduler_reserve_full_isl` (on by
    default there); off, only the first chunk must fit, as vLLM did before it, which admits
    long prompts that are preempted a few steps later."""
    sglang: SglangConfig = SglangConfig()
    """The `sglang_*` policies' scheduler (preempt.engine.sglang_scheduler)."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        return SCHEDULING_POLICIES.check(name)


class ClockConfig(_Section):
    kind: Literal["virtual", "wall"] = "virtual"
    """`virtual`: step durations from the target's cost model (deterministic)."""
    target: str = "h200-llama3-8b"
    """Deployment the virtual clock models: a built-in name (preempt.core.profiles.TARGETS)
    or a profile file (`*.json`, as `preempt calibrate` writes; docs/clock.md)."""

    @field_validator("target")
    @classmethod
    def _known_target(cls, name: str) -> str:
        from preempt.core.profiles import TARGETS, ProfileError, load_target

        if name.endswith(".json"):
            try:
                load_target(name)  # refused here, with the missing field named, not mid-run
            except ProfileError as err:
                raise ValueError(str(err)) from None
        elif name not in TARGETS:
            raise ValueError(
                f"unknown target '{name}'; choose one of {sorted(TARGETS)} or a profile .json file"
            )
        return name


class WorkloadConfig(_Section):
    trace: str = "azure-conv"
    """Bundled trace name (azure-conv, azure-code, mooncake-synthetic) or a file path."""
    start_s: float = Field(0.0, ge=0)
    """Skip the trace's first `start_s` seconds (before rate scaling)."""
    duration_s: float | None = Field(None, gt=0)
    """Keep only arrivals in [start_s, start_s + duration_s) of the trace (before scaling)."""
    num_requests: int | None = Field(None, gt=0)
    """Keep at most this many requests (after slicing)."""
    rate_scale: float = Field(1.0, gt=0)
    """Multiply the arrival rate: arrival times are divided by this."""
    arrival: Literal["trace", "poisson", "gamma"] = "trace"
    """`trace`: the trace's own timestamps; `poisson`/`gamma`: synthetic arrivals at the
    trace's mean rate (times rate_scale), lengths still from the trace."""
    gamma_cv: float = Field(3.0, gt=0)
    """Coefficient of variation of gamma inter-arrivals (bursty when > 1)."""
    sla_mix: dict[int, float] = Field(default_factory=lambda: {0: 0.8, 1: 0.2})
    """SLA level -> share of requests (higher level = more important; e.g. 1 = VIP)."""
    max_tokens_mode: Literal["trace", "fixed", "noisy"] = "fixed"
    """What the scheduler is told as max_tokens: a fixed cap, as clients send it (the
    default: docs/design.md §1), the true length times lognormal noise (an estimate), or
    the trace's true length (`trace`: an oracle, for labelled upper bounds only)."""
    max_tokens_fixed: int = Field(1024, gt=0)
    """max_tokens in `fixed` mode, and the upper clamp in `noisy` mode."""
    max_tokens_noise: float = Field(0.5, ge=0)
    """Sigma of the lognormal noise in `noisy` mode."""

    @field_validator("sla_mix")
    @classmethod
    def _check_mix(cls, mix: dict[int, float]) -> dict[int, float]:
        if not mix:
            raise ValueError("sla_mix must name at least one SLA level")
        if any(share < 0 for share in mix.values()):
            raise ValueError("sla_mix shares must be >= 0")
        total = sum(mix.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"sla_mix shares must sum to 1, got {total}")
        return mix


class PriorityWeights(_Section):
    """Weights of `score = age_s * age + sla_level * sla - remaining_ktokens * tokens`.

    Units are explicit: age in seconds since arrival, SLA level as an integer class,
    remaining work in *thousands* of tokens (prompt still to prefill + max_tokens still to
    generate). With raw tokens the token term would swamp the others (a 2k-token prompt
    would outweigh 15 minutes of age at the design's weights)."""

    age: float = Field(1.2, ge=0)
    sla: float = Field(0.8, ge=0)
    tokens: float = Field(0.5, ge=0)
    age_cap_s: float | None = Field(None, gt=0)
    """Age counts up to this many seconds (None: without bound, the design's formula). A
    cap bounds what waiting can buy: with `age * age_cap_s < sla`, age orders requests
    within an SLA level but never lifts one over a whole level, however long it waits. At
    the design's 1.2/s against 0.8 a level, an unbounded age term outranks a level in
    0.7 s, so on a wall clock with seconds-long requests the score is first-come order in
    all but name (the vLLM plugin's defaults cap it; docs/vllm_plugin.md)."""


class TimeSliceConfig(_Section):
    """Slice lengths by the request's current length (prompt + generated tokens)."""

    long_ms: float = Field(50.0, gt=0)
    """Requests longer than `long_above_tokens`."""
    medium_ms: float = Field(20.0, gt=0)
    short_ms: float = Field(10.0, gt=0)
    """Requests shorter than `short_below_tokens`."""
    long_above_tokens: int = Field(512, gt=0)
    short_below_tokens: int = Field(128, gt=0)
    static_ms: float = Field(20.0, gt=0)
    """The one slice of the `static` strategy."""


class BackoffConfig(_Section):
    """After a preemption failure, new admissions wait base * 2^(k-1) seconds (k =
    failures in a row, capped); k resets after `reset_after_s` without a failure."""

    base_s: float = Field(0.05, gt=0)
    cap_s: float = Field(2.0, gt=0)
    reset_after_s: float = Field(10.0, gt=0)
    counts: Literal["all", "priority"] = "all"
    """Which failures start the backoff (and count toward k). `all` (the engine's default,
    docs/design.md §7): every one, including a request marked PREEMPTION_FAILED after a
    forced (out-of-blocks) preemption made it reach `max_consecutive_preemptions`, and a
    failed save of a forced preemption or a reclaim. `priority`: only failures of a
    priority preemption, the one kind the trigger decides (the vLLM plugin's default:
    under steady memory pressure vLLM's forced preemptions marked a request every few
    seconds, k climbed to the 2 s cap, and the backoff held every new request, the urgent
    class first, with the pool free; such requests are still marked and protected)."""


class MlfqConfig(_Section):
    """FastServe's skip-join multi-level feedback queue (docs/fastserve.md; the defaults are
    its public artifact's, LLMServe/FastServe fastserve/scheduler.py): queue k has quantum
    `base_quantum_ms * quantum_ratio**k`; a new request joins the first queue whose quantum
    covers its first iteration, moves one queue down when an iteration leaves its time at
    that level above the quantum, and a request waiting `starvation_s` since its last
    iteration is moved to the top queue at every `starvation_every_steps`-th step."""

    num_levels: int | None = Field(None, ge=1)
    """None: as many queues as requests reach (FastServe creates them on demand)."""
    base_quantum_ms: float = Field(10.0, gt=0)
    quantum_ratio: float = Field(2.0, gt=1)
    starvation_s: float = Field(3.0, gt=0)
    starvation_every_steps: int = Field(1000, gt=0)
    join_tokens_per_ms: float = Field(40.0, gt=0)
    """Prompt tokens one millisecond of prefill covers, to place a new request (FastServe
    reads the prefill time of the prompt alone from a profile): ~40 on the virtual H200
    serving Llama-3-8B, whose 2,048-token prefill step takes ~48 ms (docs/clock.md)."""


class PreemptionConfig(_Section):
    """The design's `preemption` section (serve_config.json), extended."""

    mode: str = "recompute"
    """What happens to a victim's KV, a mode of `preempt.core.registry.PREEMPTION_MODES`
    (which also names the codec each saves with): `recompute`: dropped and recomputed
    (vLLM V1); `swap`: saved raw to host memory (vLLM V0 swap); `swap_zstd`: saved with
    zstd; `swap_mixed`: saved mixed-precision by a head plan (FP16 / FP8 / drop per KV
    head, docs/design.md §9; lossy); `pause`: kept resident until its blocks are needed
    (zero-copy; saved with `reclaim_codec` when reclaimed)."""
    time_slice_strategy: Literal["static", "dynamic"] = "dynamic"
    slice_mode: Literal["gate", "quantum"] = "gate"
    """What a used-up time slice does. `gate`: it only makes the request eligible for
    priority preemption (a challenger must still beat its score by the margin). `quantum`:
    time sharing -- when more requests want to run than fit, a request that has used its
    slice yields to the best waiting one of its SLA level or above, so the slice length
    decides who runs (each still runs at least one slice per turn)."""
    min_time_slice_ms: float = Field(10.0, ge=0)
    """No slice is shorter than this."""
    time_slices: TimeSliceConfig = TimeSliceConfig()
    priority_weights: PriorityWeights = PriorityWeights()
    threshold: float = Field(0.2, ge=0)
    """A challenger must beat a running request's score by threshold * max(|score|,
    score_floor): 20% of the incumbent's magnitude, never less than 20% of the floor."""
    score_floor: float = Field(1.0, gt=0)
    """Keeps the margin meaningful when the incumbent's score is near zero."""
    remaining: Literal["max_tokens", "learned", "oracle"] = "max_tokens"
    """The remaining output the score (and `srpt`) reads (preempt.engine.remaining):
    `max_tokens`: what the server is told, the output the client's cap still allows;
    `learned`: the expected output still to come given the prompt length, the cap and the
    tokens so far, under an output-length model, re-estimated after every token;
    `oracle`: the true output length (an upper bound; arms using it are labelled oracle)."""
    length_model: str | None = None
    """`remaining: learned`: a `preempt lengths` file. None: fitted from the trace's
    records outside the window the run replays (never the requests being judged)."""
    srpt_starvation_s: float = Field(5.0, gt=0)
    """`srpt`: a request waiting this long since it last ran (or arrived) goes ahead of
    every non-starving one, oldest first (the starvation guard)."""
    srpt_preempt_below: float = Field(0.5, ge=0, le=1)
    """`srpt`: a running request can be displaced only while it has made less than this
    share of its expected output (Trail's limited preemption; 0: never, 1: always)."""
    mlfq: MlfqConfig = MlfqConfig()
    """`fastserve_mlfq`: the queues of FastServe's skip-join MLFQ."""
    max_preemption_per_min: int | None = Field(30, gt=0)
    """Priority preemptions allowed in any 60 s window of the engine's clock (None: no
    cap). Preemptions forced by running out of KV blocks are never blocked; whether they
    count toward the cap is `rate_cap_counts`."""
    rate_cap_counts: Literal["all", "priority"] = "all"
    """Which preemptions fill the cap's window. `all`: forced (memory) ones too, so the cap
    bounds all churn and memory pressure leaves less room for priority preemptions (the
    engine's default: the design's cap "bounds thrashing"). `priority`: only the ones the
    cap can refuse, so a burst of forced preemptions never spends the budget the urgent
    class needs to displace (the vLLM plugin's default)."""
    max_consecutive_preemptions: int = Field(3, gt=0)
    """A request already preempted this many times is marked PREEMPTION_FAILED instead of
    preempted again, and runs to completion."""
    failure_fallback: bool | None = None
    """The failure fallback (PREEMPTION_FAILED after `max_consecutive_preemptions` or a
    failed save, protected victims, admission backoff). None: the policy's own default --
    on for `priority_score`, off for the vLLM and SGLang baselines, which have none of it
    (a failed save there simply drops the KV for recompute)."""
    backoff: BackoffConfig = BackoffConfig()
    host_mem: int | str = Field("4GB", validate_default=True)
    """Host pool for saved KV (`--preemption-host-mem`), in the KV bytes of the backend
    that stores them (the tiny model's real KV; the target's modelled KV with `null`)."""
    slot_size: int | str = Field("256MB", validate_default=True)
    """The largest saved-KV blob the pool takes (`--preemption-slot-size`); the pool
    stores each blob in exactly its own size."""
    zstd_level: int = Field(3, ge=1, le=22)
    zstd_threads: int = Field(0, ge=0)
    zstd_shuffle: bool = True
    """Byte-shuffle before zstd (high bytes of fp16 together): smaller and faster."""
    head_plan: str = "random"
    """`swap_mixed`: which KV heads stay FP16, go FP8 or are dropped. `fp16` / `fp8`
    (uniform), `random` (seeded by `seed`, shares below: the control), or the path of a
    JSON plan file (`preempt importance` writes one from gradient head importance)."""
    head_plan_fp8_share: float = Field(0.5, ge=0, le=1)
    head_plan_drop_share: float = Field(0.1, ge=0, le=1)
    """`random` plan shares (docs/design.md §9: 10% dropped; 50% FP8 + 40% FP16 gives the design's
    0.65x of FP16 bytes)."""
    mixed_zstd: bool = False
    """`swap_mixed`: also zstd the packed payload on the host (costs host CPU time)."""
    warmup_tokens: int = Field(2, ge=0)
    """After a lossy restore, recompute the last this-many tokens at full precision
    (the design's "1-2 tokens of warm-up")."""
    reclaim_codec: str = "raw"
    """How `pause` saves a paused request when its blocks are reclaimed: a codec of
    `preempt.core.registry.RECLAIM_CODECS` (`raw` or `zstd`)."""
    async_restore: bool = False
    """Restore saved KV asynchronously (as vLLM's KV connectors load remote KV,
    WAITING_FOR_REMOTE_KVS): a request admitted with its KV on the host gets its blocks
    and a seat, and its copy-in starts on the link, but it stays out of the batch (READY)
    until the copy ends on the virtual clock; the rest of the batch runs meanwhile. Off:
    the whole step waits for the restore (the baselines, vLLM parity). Virtual clock only,
    and not for the `sglang_*` policies' loop."""
    codec_encode_mb_s: dict[str, float] = Field(
        default_factory=lambda: {"raw": 0.0, "zstd": 480.0, "mixed": 0.0}
    )
    """Virtual clock: host-side encode throughput per codec (0 = free), calibrated with
    `preempt bench save` on this kind of machine (zstd L3 + shuffle, one core)."""
    codec_decode_mb_s: dict[str, float] = Field(
        default_factory=lambda: {"raw": 0.0, "zstd": 1000.0, "mixed": 0.0}
    )
    """`mixed` quantizes on the device (Triton) before the PCIe copy, so it costs no host
    time unless `mixed_zstd`; then zstd's throughput applies to its (smaller) payload."""
    modelled_ratio: dict[str, float] = Field(default_factory=lambda: {"raw": 1.0, "zstd": 1.15})
    """`null` backend (no real KV): compression ratio assumed per codec (measured on the
    tiny model's KV by `preempt bench save`)."""

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        return check_mode(mode)

    @field_validator("reclaim_codec")
    @classmethod
    def _known_reclaim_codec(cls, name: str) -> str:
        return check_reclaim_codec(name)

    @field_validator("head_plan")
    @classmethod
    def _plan_name_or_file(cls, value: str) -> str:
        if value not in ("fp16", "fp8", "random") and not Path(value).is_file():
            raise ValueError(f"'{value}' is neither fp16, fp8, random nor an existing plan file")
        return value

    @field_validator("host_mem", "slot_size")
    @classmethod
    def _size(cls, value: int | str) -> int:
        from preempt.core.sizes import parse_size

        size = parse_size(value)
        if size <= 0:
            raise ValueError(f"must be > 0 bytes, got {value!r}")
        return size

    @model_validator(mode="after")
    def _plan_shares_fit(self) -> PreemptionConfig:
        if self.head_plan_fp8_share + self.head_plan_drop_share > 1.0 + 1e-9:
            raise ValueError(
                f"head_plan_fp8_share + head_plan_drop_share must be <= 1, got "
                f"{self.head_plan_fp8_share} + {self.head_plan_drop_share}"
            )
        return self

    @model_validator(mode="after")
    def _slot_fits_pool(self) -> PreemptionConfig:
        if self.slot_size > self.host_mem:
            raise ValueError(
                f"slot_size ({self.slot_size} B) exceeds host_mem ({self.host_mem} B): raise "
                "--preemption-host-mem or lower --preemption-slot-size"
            )
        return self

    def fills_rate_cap(self, forced: bool) -> bool:
        """Whether a preemption (`forced`: by running out of KV blocks) is recorded in the
        rate cap's window (`rate_cap_counts`)."""
        return not forced or self.rate_cap_counts == "all"


class EarlySaveConfig(_Section):
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
    per-thread rate (`preemption.codec_decode_mb_s`)."""
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


class SLOConfig(_Section):
    """Latency objectives per SLA level, for goodput and SLO attainment. Levels not
    listed use level 0's. Defaults: interactive-chat targets of the range that
    vLLM/DistServe evaluations use, tighter for VIP (level 1)."""

    ttft_s: dict[int, float] = Field(default_factory=lambda: {0: 5.0, 1: 1.0})
    tpot_s: dict[int, float] = Field(default_factory=lambda: {0: 0.2, 1: 0.1})

    @field_validator("ttft_s", "tpot_s")
    @classmethod
    def _check_levels(cls, slos: dict[int, float]) -> dict[int, float]:
        if 0 not in slos:
            raise ValueError("must define level 0 (the default for unlisted levels)")
        if any(v <= 0 for v in slos.values()):
            raise ValueError("SLOs must be > 0 seconds")
        return slos

    def for_level(self, level: int) -> tuple[float, float]:
        return self.ttft_s.get(level, self.ttft_s[0]), self.tpot_s.get(level, self.tpot_s[0])


class ServeConfig(_Section):
    """`preempt serve`'s own defaults (the engine ignores this section)."""

    default_max_tokens: int | None = Field(256, gt=0)
    """Output budget of a chat request that sets neither `max_tokens` nor
    `max_completion_tokens`: at most this many tokens, fewer when the context or the KV
    cache leaves less after the prompt. None: vLLM's and OpenAI's default, all the context
    the prompt leaves (thousands of tokens: minutes of CPU for the tiny model). Completions
    default to 16 (OpenAI's and vLLM's) whatever this says."""


class EngineConfig(_Section):
    seed: int = 0
    """Seeds model init, prompt tokens, SLA assignment and sampling."""
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    clock: ClockConfig = ClockConfig()
    workload: WorkloadConfig = WorkloadConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    early_save: EarlySaveConfig = EarlySaveConfig()
    slo: SLOConfig = SLOConfig()
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _early_saves_need_a_save_path(self) -> EngineConfig:
        if self.early_save.policy != "none" and self.preemption.mode == "recompute":
            *saving, last = (mode for mode in PREEMPTION_MODES if mode != "recompute")
            raise ValueError(
                f"early_save.policy '{self.early_save.policy}' needs a preemption.mode that saves KV "
                f"({', '.join(saving)} or {last}), not recompute"
            )
        uses_lookahead = self.early_save.policy in ("lookahead", "forecast") or self.early_save.prefetch
        if uses_lookahead and self.clock.kind != "virtual":
            raise ValueError(
                "early_save.policy 'lookahead' or 'forecast' and early_save.prefetch need "
                "clock.kind 'virtual'"
            )
        if self.early_save.policy == "lstm" and self.early_save.feature_set == "forecast":
            if self.clock.kind != "virtual":
                raise ValueError(
                    "early_save.feature_set 'forecast' forks the engine every few steps and needs "
                    "clock.kind 'virtual' (a fork cannot replay real time)"
                )
        if self.early_save.prefetch and self.preemption.mode == "recompute":
            raise ValueError("early_save.prefetch needs a preemption.mode that saves KV, not recompute")
        if self.preemption.async_restore and self.clock.kind != "virtual":
            # On the wall clock a restore runs on the engine thread inside schedule() (decode
            # and scatter), with no copy stream or completion event to overlap the step with.
            raise ValueError(
                "preemption.async_restore needs clock.kind 'virtual': on the wall clock restores "
                "run synchronously on the engine thread (no asynchronous copy-in to wait for)"
            )
        return self


def format_validation_error(err: ValidationError, noun: str = "config key") -> str:
    """pydantic's first error as one line naming the dotted key: "unknown <noun> 'a.b'" or
    "<noun> 'a.b': <message>". Every pydantic-validated input of the project (engine
    config, ablation files, parity workloads, the vLLM plugin's settings) words its errors
    this way; `noun` is what the input calls its keys."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    if first["type"] == "extra_forbidden":
        return f"unknown {noun} '{key}'"
    return f"{noun} '{key}': {first['msg']}"


def build_config(data: dict[str, Any]) -> EngineConfig:
    """Validate a nested dict into an EngineConfig, raising ConfigError naming the key."""
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


BUNDLED_CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"
"""The configs that ship with the repository (experiments/configs/): a relative config path
that is not found where it is given is looked up here, so `--config engine_quick.yaml`
works from any directory (a checkout's; an installed wheel carries none of them)."""


def find_config_file(path: str | Path, beside: str | Path | None = None) -> Path:
    """Where the config file `path` is: as given (relative to the cwd; or, given `beside`,
    relative to that directory, as an ablation's `base_config` is to its file), else, for a
    relative path, among the bundled configs (BUNDLED_CONFIGS). Raises ConfigError listing
    every place it looked."""
    path = Path(path)
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [path if beside is None else Path(beside) / path, BUNDLED_CONFIGS / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = " and ".join(str(candidate.absolute()) for candidate in candidates)
    raise ConfigError(f"config file not found: {path} (looked for {looked})")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict (no validation yet); a relative path missing from
    the cwd is looked up among the bundled configs (`find_config_file`)."""
    path = find_config_file(path)
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {err}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value), the value parsed as YAML (so 10, 0.5, true, null and
    {0: 1.0} keep their types; what YAML cannot parse stays a string)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    key, raw = assignment.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `data["a"]["b"]["c"] = value` for key "a.b.c" in place, creating sections."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"empty key in '{key}'")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `--set a.b.c=value` override in place (`parse_assignment`, `set_dotted`)."""
    key, value = parse_assignment(assignment)
    try:
        set_dotted(data, key, value)
    except ConfigError as err:
        raise ConfigError(f"--set {assignment}: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> EngineConfig:
    """Config file (optional) + `--set` overrides -> validated EngineConfig."""
    data = read_config_file(path) if path is not None else {}
    for assignment in overrides:
        apply_override(data, assignment)
    return build_config(data)
