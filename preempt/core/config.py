"""Frozen, validated configuration for every layer of the engine.

Owns: the schema (one section per layer), loading from JSON/YAML, `--set key=value`
overrides, and error messages that name the offending key. Runtime facts (the number of
blocks actually allocated, the model's vocabulary) live in state objects, never here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from preempt.core.config_base import ConfigError, Section, format_validation_error
from preempt.core.early_save_config import EarlySaveConfig
from preempt.core.registry import (
    CODECS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    check_mode,
    check_reclaim_codec,
)

# Keys that moved when codec options and calibration left `preemption` (2026-12-07): a config
# that still sets one is refused with the key's new place; stored run configs are read
# through `upgrade_config`.
MOVED_PREEMPTION_KEYS: dict[str, str] = {
    "zstd_level": "preemption.codecs.zstd.level",
    "zstd_threads": "preemption.codecs.zstd.threads",
    "zstd_shuffle": "preemption.codecs.zstd.shuffle",
    "head_plan": "preemption.codecs.mixed.plan",
    "head_plan_fp8_share": "preemption.codecs.mixed.fp8_share",
    "head_plan_drop_share": "preemption.codecs.mixed.drop_share",
    "mixed_zstd": "preemption.codecs.mixed.zstd",
    "codec_encode_mb_s": "clock.codecs.<codec>.encode_mb_s",
    "codec_decode_mb_s": "clock.codecs.<codec>.decode_mb_s",
    "modelled_ratio": "clock.codecs.<codec>.modelled_ratio",
}
"""Old `preemption` key -> where it lives now."""


def refuse_moved_keys(data: Any, section: str, moved: dict[str, str]) -> Any:
    """`data` unchanged unless it sets a key of `moved`: then ValueError naming its new place."""
    if isinstance(data, dict):
        for key in data:
            if key in moved:
                raise ValueError(f"key '{section}.{key}' has moved: set '{moved[key]}' instead")
    return data


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A stored engine config (a run's `config`, as dumped) in today's layout: keys of
    `MOVED_PREEMPTION_KEYS` moved to their new places (a copy; today's configs unchanged)."""
    preemption = dict(config.get("preemption") or {})
    if not any(key in preemption for key in MOVED_PREEMPTION_KEYS):
        return config
    clock = dict(config.get("clock") or {})
    calibration = {name: dict(values) for name, values in (clock.get("codecs") or {}).items()}
    codecs = {name: dict(options) for name, options in (preemption.get("codecs") or {}).items()}
    for key, place in MOVED_PREEMPTION_KEYS.items():
        if key in preemption:
            value = preemption.pop(key)
            section, _, name, option = place.split(".")
            if section == "clock":  # {codec: value}
                for codec, per_codec in value.items():
                    calibration.setdefault(codec, {})[option] = per_codec
            else:
                codecs.setdefault(name, {})[option] = value
    preemption["codecs"] = codecs
    clock["codecs"] = calibration
    return {**config, "preemption": preemption, "clock": clock}


def check_codec_options(name: str, options: dict[str, Any]) -> None:
    """ValueError unless codec `name` is registered and takes `options` (it is built with
    them, for a nominal model of 2 layers and 2 KV heads: a plan file must exist)."""
    if name not in CODECS.names():
        raise ValueError(f"unknown codec '{name}'; choose one of {CODECS.names()}")
    try:
        CODECS.resolve(name).build(options, 2, 2)
    except TypeError as err:
        raise ValueError(f"codec '{name}': {err}") from None
    except ValueError as err:
        raise ValueError(f"codec '{name}': {err}") from None


class ModelConfig(Section):
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


class CacheConfig(Section):
    block_size: int = Field(16, gt=0)
    """Tokens per KV block."""
    num_blocks: int | None = Field(None, gt=0)
    """Usable blocks in the pool. None: the target's KV capacity (clock.target) less the one
    block vLLM keeps as its null block (so `num_blocks` here is vLLM's `num_gpu_blocks` - 1)."""


class SglangConfig(Section):
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


class SchedulerConfig(Section):
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


class CodecCalibration(Section):
    """A codec's host side on the virtual clock; None: the codec's own value."""

    encode_mb_s: float | None = Field(None, ge=0)
    """Host encode throughput, MB/s of raw KV (0: free)."""
    decode_mb_s: float | None = Field(None, ge=0)
    """Host decode throughput, MB/s of raw KV (0: free)."""
    modelled_ratio: float | None = Field(None, gt=0)
    """`null` backend (no real KV): the compression ratio assumed (raw / stored bytes)."""

    def over(self, base: CodecCalibration) -> CodecCalibration:
        """These values where set, `base`'s elsewhere."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


class ClockConfig(Section):
    kind: Literal["virtual", "wall"] = "virtual"
    """`virtual`: step durations from the target's cost model (deterministic)."""
    target: str = "h200-llama3-8b"
    """Deployment the virtual clock models: a built-in name (preempt.core.profiles.TARGETS)
    or a profile file (`*.json`, as `preempt calibrate` writes; docs/clock.md)."""

    codecs: dict[str, CodecCalibration] = Field(default_factory=dict)
    """The host side of each codec on the virtual clock, by codec name, over that codec's
    own calibration (`Codec.calibration`, measured by `preempt bench save` on this kind of
    machine: zstd level 3 + shuffle on one core encodes 480 MB/s and decodes 1000 MB/s and
    stores real 16-bit KV in 1/1.15 of its bytes; lz4 4160 / 2880 MB/s and 1.04 (relative to
    zstd in the same run, preempt/kv/lz4.py); raw, mixed and fp8 cost no host time)."""

    @field_validator("codecs")
    @classmethod
    def _known_codecs(cls, codecs: dict[str, CodecCalibration]) -> dict[str, CodecCalibration]:
        for name in codecs:
            if name not in CODECS.names():
                raise ValueError(f"unknown codec '{name}'; choose one of {CODECS.names()}")
        return codecs

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


class WorkloadConfig(Section):
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


class PriorityWeights(Section):
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


class TimeSliceConfig(Section):
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


class BackoffConfig(Section):
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


class MlfqConfig(Section):
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


class PreemptionConfig(Section):
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
    codecs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Options of each codec, by name (`preempt.core.registry.CODECS`): the keyword
    arguments its class takes, every one with a default, e.g. `zstd: {level: 3, threads: 0,
    shuffle: true}`, `mixed: {plan: random, fp8_share: 0.5, drop_share: 0.1, zstd: false}`
    (`plan`: `fp16`, `fp8`, `random` (seeded by `seed`: the control) or a JSON plan file
    from `preempt importance`; docs/design.md §9), `lz4: {acceleration: 1, shuffle:
    false}`. Each codec checks its own (a bad name or option is refused at load)."""
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

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        return check_mode(mode)

    @field_validator("reclaim_codec")
    @classmethod
    def _known_reclaim_codec(cls, name: str) -> str:
        return check_reclaim_codec(name)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return refuse_moved_keys(data, "preemption", MOVED_PREEMPTION_KEYS)

    @field_validator("codecs")
    @classmethod
    def _codec_options(cls, codecs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, options in codecs.items():
            check_codec_options(name, options)
        return codecs

    @field_validator("host_mem", "slot_size")
    @classmethod
    def _size(cls, value: int | str) -> int:
        from preempt.core.sizes import parse_size

        size = parse_size(value)
        if size <= 0:
            raise ValueError(f"must be > 0 bytes, got {value!r}")
        return size

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


class SLOConfig(Section):
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


class ServeConfig(Section):
    """`preempt serve`'s own defaults (the engine ignores this section)."""

    default_max_tokens: int | None = Field(256, gt=0)
    """Output budget of a chat request that sets neither `max_tokens` nor
    `max_completion_tokens`: at most this many tokens, fewer when the context or the KV
    cache leaves less after the prompt. None: vLLM's and OpenAI's default, all the context
    the prompt leaves (thousands of tokens: minutes of CPU for the tiny model). Completions
    default to 16 (OpenAI's and vLLM's) whatever this says."""


class EngineConfig(Section):
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


def build_config(data: dict[str, Any]) -> EngineConfig:
    """Validate a nested dict into an EngineConfig, raising ConfigError naming the key."""
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model=EngineConfig)) from None
