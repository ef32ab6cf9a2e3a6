"""Every standard arm of the ablation matrix, in one table (`STANDARD_ARMS`): the field's
baselines, then the design of docs/design.md added one piece at a time, its tuned variant
and the oracle arms. An ablation config names them (or defines its own:
experiments.plan, which resolves arms into runs).

An arm is a name, a parent and dotted overrides (the semantics of `preempt run --set`);
its engine config is the ablation's `base` + the overrides of its ancestors, root first,
+ its own + the grid point's. Baselines set every knob they depend on, so a base config
cannot leak the design into them. Data only: no torch, nothing runs here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arm:
    """One configuration of the matrix. `set`: dotted engine-config overrides applied on
    top of the parent's; `reference`: the arm whose `preemptions.parquet` an `oracle`
    early-save arm replays (it runs first, at the same grid point)."""

    name: str
    parent: str | None
    set: Mapping[str, Any]
    doc: str
    reference: str | None = None


def _arms(*arms: Arm) -> dict[str, Arm]:
    return {arm.name: arm for arm in arms}


STANDARD_ARMS: dict[str, Arm] = _arms(
    # -- the field's baselines (docs/design.md "Facts from the field")
    Arm(
        "vllm_fcfs",
        None,
        {
            "scheduler.policy": "vllm_fcfs",
            "preemption.mode": "recompute",
            "preemption.time_slice_strategy": "static",
            "preemption.max_preemption_per_min": None,
            "early_save.policy": "none",
        },
        "vLLM 0.32.0 V1 (step-identical, docs/parity.md): preempt only when KV blocks run out, "
        "recompute, victim = last admitted",
    ),
    Arm(
        "vllm_priority",
        "vllm_fcfs",
        {"scheduler.policy": "vllm_priority"},
        "vLLM V1 priority scheduling: victim = worst (priority, arrival), recompute",
    ),
    Arm(
        "vllm_lcf",
        "vllm_fcfs",
        {"scheduler.policy": "vllm_lcf"},
        "vLLM 0.32's FCFS with RFC #54644's victim: the running request with the least computed "
        "tokens (least work thrown away), recompute; the RFC's rule, not in a vLLM release",
    ),
    Arm(
        "fcfs_swap",
        "vllm_fcfs",
        {"preemption.mode": "swap"},
        "vLLM 0.32's scheduling with the victim's raw KV swapped to host and back (vLLM V0's "
        "swap mode; not V0's scheduler, hence no system name)",
    ),
    Arm(
        "sglang_priority",
        "vllm_fcfs",
        {"scheduler.policy": "sglang_priority"},
        "SGLang 0.5.23 with priority scheduling: its own loop (prefill first, new-token-ratio "
        "admission, retraction by fewest outputs), priority preemption past the threshold, "
        "recompute, no radix cache (docs/sglang.md)",
    ),
    Arm(
        "sglang_fcfs",
        "sglang_priority",
        {"scheduler.policy": "sglang_fcfs"},
        "SGLang 0.5.23's default fcfs: no priority scheduling, no priority preemption",
    ),
    Arm(
        "uniboost",
        "sglang_fcfs",
        {"scheduler.policy": "uniboost"},
        "UniBoost (ICML 2026, its public SGLang fork): SGLang's loop with the waiting queue by "
        "entry time less a gamma-Boost of the uncached tokens (gamma 10/s, 64 µs a token)",
    ),
    # -- the design (docs/design.md), one piece at a time
    Arm(
        "score",
        "vllm_priority",
        {"scheduler.policy": "priority_score", "preemption.threshold": 0.2},
        "docs/design.md §1: priority score + 20% trigger margin (one static slice, recompute, no cap)",
    ),
    Arm(
        "score_age_cap",
        "score",
        {"preemption.priority_weights.age_cap_s": 10.0},
        "a named variant of the design: the age term saturates at 10 s, so waiting orders requests "
        "within an SLA level but never lifts one over a level (at the quick weights 0.05/s x 10 s "
        "= 0.5 < 0.8 a level); the suspect in the top class's TTFT p99 against strict priority",
    ),
    Arm(
        "score_learned",
        "score",
        {"preemption.remaining": "learned"},
        "the design with a learned estimate of the remaining output (preempt.engine.remaining: "
        "expected output left given prompt length, cap and tokens so far, fitted outside the "
        "replayed window, re-estimated every token) instead of what max_tokens allows",
    ),
    Arm(
        "score_oracle",
        "score",
        {"preemption.remaining": "oracle"},
        "oracle: the design told each request's true output length (an upper bound on what "
        "length knowledge is worth to it)",
    ),
    # The design where it can win (docs/results.md): the score kept, the SLA level put first.
    Arm(
        "score_class",
        "score",
        {"scheduler.policy": "priority_score_class"},
        "the design's score inside an SLA class, the class first: strict priority's order "
        "between classes (admission, victim, displacement), the score and its margin within one",
    ),
    Arm(
        "score_class_nofallback",
        "score_class",
        {"preemption.failure_fallback": False},
        "score_class without the design's failure fallback (docs/design.md §7: PREEMPTION_FAILED "
        "after 3 preemptions in a row, protected victims, the admission backoff), which holds new "
        "requests of every class, the top one first, while the pool churns",
    ),
    Arm("threshold_0", "score", {"preemption.threshold": 0.0}, "score with no margin (sensitivity)"),
    Arm("threshold_50", "score", {"preemption.threshold": 0.5}, "score with a 50% margin (sensitivity)"),
    Arm(
        "slices_dynamic",
        "score",
        {"preemption.time_slice_strategy": "dynamic"},
        "docs/design.md §3: time slice by request length (50/20/10 ms) instead of one static slice",
    ),
    Arm(
        "rate_limit",
        "slices_dynamic",
        {"preemption.max_preemption_per_min": 30},
        "docs/design.md §6: at most 30 priority preemptions per minute",
    ),
    Arm(
        "rate_limit_tight",
        "slices_dynamic",
        {"preemption.max_preemption_per_min": 8},
        "a cap of 8 priority preemptions per minute: under the quick load's uncapped peak (7-17), "
        "so the cap decides and its cost shows",
    ),
    Arm(
        "pause",
        "rate_limit",
        {"preemption.mode": "pause", "preemption.async_restore": True},
        "docs/design.md §4: zero-copy pause; KV moves only when its blocks are reclaimed (restored "
        "asynchronously then)",
    ),
    Arm(
        "swap_zstd",
        "rate_limit",
        {"preemption.mode": "swap_zstd", "preemption.async_restore": True},
        "docs/design.md §2: save KV with zstd (level 3) to the host pool (serve_config.json's design); "
        "restores asynchronous: a readmitted request waits out of the batch for its copy-in",
    ),
    Arm(
        "swap_zstd_static",
        "swap_zstd",
        {"preemption.time_slice_strategy": "static"},
        "swap_zstd with one static slice: the dynamic-slice claim on a saving mode",
    ),
    Arm(
        "swap_raw",
        "swap_zstd",
        {"preemption.mode": "swap"},
        "the design saving raw KV: isolates what zstd costs on the critical path",
    ),
    Arm(
        "swap_lz4",
        "swap_zstd",
        {"preemption.mode": "swap_lz4"},
        "swap_zstd with LZ4 instead (preempt/kv/lz4.py): a host codec several times faster than "
        "zstd and compressing less: does a faster CPU codec pay for itself on the critical path?",
    ),
    Arm(
        "swap_raw_sync",
        "swap_raw",
        {"preemption.async_restore": False},
        "swap_raw with synchronous restores (the batch waits for each copy-in, as vLLM V0's swap): "
        "what asynchronous restores win",
    ),
    Arm(
        "swap_mixed",
        "swap_zstd",
        {"preemption.mode": "swap_mixed"},
        "docs/design.md §9: mixed-precision save (FP16/FP8/drop per KV head), lossy",
    ),
    Arm(
        "swap_fp8",
        "swap_mixed",
        {"preemption.codecs.mixed.plan": "fp8"},
        "uniform FP8 (E4M3, per-head scales): the field's baseline for lossy saves, 2x smaller",
    ),
    # -- slices that decide (time sharing) and FastServe's MLFQ
    Arm(
        "time_share_dynamic",
        "pause",
        {"preemption.slice_mode": "quantum"},
        "docs/design.md §3 as time sharing: a request that used its slice yields its seat to the best "
        "waiting one of its level or above (KV paused, saved if its blocks are needed)",
    ),
    Arm(
        "time_share_static",
        "time_share_dynamic",
        {"preemption.time_slice_strategy": "static"},
        "time sharing with one static slice: the dynamic-slice claim where slices decide",
    ),
    Arm(
        "time_share_swap",
        "time_share_dynamic",
        {"preemption.mode": "swap"},
        "time sharing whose yields save raw KV and restore it: the zero-copy pause's twin where "
        "preempted requests resume soon",
    ),
    Arm(
        "time_share_uncapped",
        "time_share_dynamic",
        {"preemption.max_preemption_per_min": None},
        "time sharing without the 30-per-minute cap: every used-up slice may yield (the rate cap's "
        "twin where it binds)",
    ),
    Arm(
        "time_share_uncapped_static",
        "time_share_uncapped",
        {"preemption.time_slice_strategy": "static"},
        "uncapped time sharing with one static slice: the dynamic-slice claim without the cap",
    ),
    Arm(
        "fastserve_mlfq",
        "vllm_fcfs",
        {
            "scheduler.policy": "fastserve_mlfq",
            # Proactive KV management as FastServe's artifact does it (docs/fastserve.md): a
            # request out of the batch keeps its KV on the GPU until its blocks are needed,
            # then it is swapped out raw, lowest queue first; swap-ins run beside compute and
            # the next requests' KV is swapped in ahead, up to a batch's worth.
            "preemption.mode": "pause",
            "preemption.reclaim_codec": "raw",
            "preemption.async_restore": True,
            "early_save.prefetch": True,
            "early_save.prefetch_depth": 16,
            "early_save.prefetch_block_share": 1.0,
        },
        "FastServe (arXiv 2305.05920; its artifact's rules, docs/fastserve.md): skip-join MLFQ at "
        "iteration granularity, starvation promotion, KV kept on the GPU until needed, swapped out "
        "raw and in ahead",
    ),
    Arm(
        "srpt",
        "vllm_fcfs",
        {"scheduler.policy": "srpt", "preemption.remaining": "learned"},
        "the length-aware baseline (docs/srpt.md): shortest learned remaining work first "
        "(Fu et al. 2024; Trail, ICLR 2025), a 5 s starvation guard, preemption only in the "
        "first half of a request's expected output, recompute; no SLA classes",
    ),
    Arm(
        "srpt_oracle",
        "srpt",
        {"preemption.remaining": "oracle"},
        "oracle: srpt told each request's true output length (an upper bound)",
    ),
    Arm(
        "early_always",
        "swap_mixed",
        {"early_save.policy": "always"},
        "early saves of every running request (write-through, like SGLang HiCache)",
    ),
    Arm(
        "early_rule",
        "swap_mixed",
        {"early_save.policy": "rule"},
        "early save of the lowest-priority request whose slice is used up",
    ),
    Arm(
        "early_lstm",
        "swap_mixed",
        {"early_save.policy": "lstm"},
        "docs/design.md §8: early saves triggered by the trained LSTM predictor (needs `predictor`)",
    ),
    Arm(
        "early_oracle",
        "swap_mixed",
        {"early_save.policy": "oracle"},
        "early saves from the reference run's real preemptions (upper bound)",
        reference="swap_mixed",
    ),
    Arm(
        "early_forecast",
        "swap_mixed",
        {
            "early_save.policy": "forecast",
            "early_save.horizon_steps": 4,
            "early_save.lookahead_every_steps": 4,
        },
        "early saves from a fork of the engine knowing only the present, forked on news or every 4 steps",
    ),
    # -- the tuned design: the best trial of `preempt tune --config preempt/configs/tune.yaml
    # --out runs/tune --jobs 1` (its best.yaml's `set`, copied as is; the study:
    # benchmarks/tune_2026-12-04.json), tuned with max_tokens as clients send it (a 1024 cap).
    # A named variant of the design, never its default: `score` keeps the specified values.
    Arm(
        "score_tuned",
        "score",
        {
            "preemption.priority_weights.age": 0.0015525645040799646,
            "preemption.priority_weights.sla": 3.7868239034845295,
            "preemption.priority_weights.tokens": 1.6907270061133377,
            "preemption.priority_weights.age_cap_s": None,
            "preemption.threshold": 0.5775170007258288,
            "preemption.time_slice_strategy": "static",
            "preemption.slice_mode": "gate",
            "preemption.max_preemption_per_min": None,
            "preemption.mode": "recompute",
            "preemption.remaining": "max_tokens",
        },
        "`preempt tune --config preempt/configs/tune.yaml --out runs/tune`: trial 54 of the study (TPE, "
        "sampler seed 0), maximizing the mean goodput_req_s over 9 training runs with mean "
        "sla2_ttft_p99_s <= 1: 3.282, sla2_ttft_p99_s 0.97 (the parent score's own values, trial 0: "
        "2.889, 5.31)",
    ),
    # The tuned design with each other remaining-work estimate: what length knowledge is
    # worth to it (the claims report's oracle share, per design arm).
    Arm(
        "score_tuned_learned",
        "score_tuned",
        {"preemption.remaining": "learned"},
        "the tuned design with the learned estimate of the remaining output",
    ),
    # The tuned weights where they keep the top class: class first, no failure fallback.
    Arm(
        "score_tuned_class",
        "score_tuned",
        {"scheduler.policy": "priority_score_class", "preemption.failure_fallback": False},
        "the tuned weights inside an SLA class, the class first, without the failure fallback "
        "(score_class_nofallback's two changes on score_tuned)",
    ),
    Arm(
        "score_tuned_class_learned",
        "score_tuned_class",
        {"preemption.remaining": "learned"},
        "score_tuned_class with the learned estimate of the remaining output",
    ),
    Arm(
        "score_tuned_oracle",
        "score_tuned",
        {"preemption.remaining": "oracle"},
        "oracle: the tuned design told each request's true output length (an upper bound)",
    ),
)
