"""The claims that keep their own logic: each judges several arm pairs in order, finds its
arm by configuration, or reads more than one paired interval. A claim that is one paired
interval against a bound is declared instead (experiments.claims.paired); every claim is
listed, with its sentence and method, in experiments.claims.catalogue.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from experiments.claims.base import (
    DTYPE_BITS,
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    REDUCTION,
    RELATIVE_CHANGE,
    Finding,
    all_of,
    difference,
    fmt,
    interval_of,
    is_nan,
    missing,
    n_seeds,
    pct,
    relative,
    same_metrics,
    show,
)
from experiments.dominance import (
    OBJECTIVES,
    WORSE,
    Arms,
    compare_arms,
    is_baseline,
    paired,
    paired_interval,
    top_level,
)
from preempt.obs.stats import compare, ratio_interval, t_interval

# ---------------------------------------------------------------- from the ablations' arms


def threshold_margin(arms: Arms) -> Finding:
    names = ("threshold_0", "score", "threshold_50")
    rows = paired(arms, *names)
    if rows is None:
        return missing(arms, *names)
    zero, score, fifty = rows
    top = top_level(score)
    parts = [
        f"goodput {show(zero, 'goodput_req_s')} / {show(score, 'goodput_req_s')} / "
        f"{show(fifty, 'goodput_req_s')} req/s at margins 0 / 0.2 / 0.5",
        f"level-{top} TTFT p99 {show(score, f'sla{top}_ttft_p99_s')} s at 0.2",
    ]
    if same_metrics(zero, score) and same_metrics(score, fifty):
        return Finding("; ".join(parts) + f"; the margin changed nothing ({n_seeds(score)})", IDLE)
    decisions = []
    for name, other in (("0", zero), ("0.5", fifty)):
        rel = paired_interval(score, other, relative("goodput_req_s")).clip(*RELATIVE_CHANGE)
        parts.append(f"0.2 vs {name}: {pct(rel)}")
        decisions.append(compare(rel, -0.01, claimed="above"))
    return Finding("; ".join(parts) + f" ({n_seeds(score)})", all_of(*decisions))


def front(arm: str) -> Callable[[Arms], Finding]:
    """`arm` against every named baseline present (experiments.dominance): held when it is
    better than each on one of the OBJECTIVES (paired intervals), did not hold when one
    dominates it."""

    def evaluate(arms: Arms) -> Finding:
        baselines = [name for name in arms if is_baseline(name)]
        if arm not in arms or not baselines:
            return missing(arms, arm, *(baselines or ["vllm_priority"]))
        comparisons = [c for b in baselines if (c := compare_arms(arms, b, arm)) is not None]
        if not comparisons:
            return missing(arms, arm, *baselines)
        parts = []
        for c in comparisons:
            diffs = ", ".join(f"{o.label} {fmt(d)}" for o, d in zip(OBJECTIVES, c.diffs, strict=True))
            wins = [o.label for o, side in zip(OBJECTIVES, c.sides, strict=True) if side == WORSE]
            state = (
                "dominates it" if c.dominates else f"{arm} better on {' and '.join(wins)}" if wins else "tied"
            )
            parts.append(f"{c.challenger} - {arm}: {diffs} ({state})")
        measured = "; ".join(parts) + f" (n={comparisons[0].num_seeds} seeds)"
        if all(all(d.mean == 0 and d.lo == d.hi == 0 for d in c.diffs) for c in comparisons):
            return Finding(measured + "; every policy ran alike", IDLE)
        if any(c.dominates for c in comparisons):
            return Finding(measured, NOT_HELD)
        if all(WORSE in c.sides for c in comparisons):
            return Finding(measured, HELD)
        return Finding(measured, INCONCLUSIVE)

    return evaluate


def _overhead_metric(row: dict[str, Any]) -> tuple[str, str]:
    if row["_config"]["preemption"]["mode"] == "recompute":
        return "recomputed_tokens", "recomputed tokens"
    return "preemption_stall_s", "s of stall"


# (fixed slice, dynamic slice): the first pair that ran and differs decides, time-sharing first
SLICE_PAIRS = (
    ("time_share_static", "time_share_dynamic"),
    ("time_share_uncapped_static", "time_share_uncapped"),
    ("swap_zstd_static", "swap_zstd"),
    ("score", "slices_dynamic"),
)


def dynamic_slices(arms: Arms) -> Finding:
    parts, verdict = [], None
    for static, dynamic in SLICE_PAIRS:
        rows = paired(arms, static, dynamic)
        if rows is None:
            continue
        metric, unit = _overhead_metric(rows[0][0])
        if same_metrics(*rows):
            parts.append(f"{static} and {dynamic} ran identically in every seed: the slice never decided")
            continue
        if not any(r[metric] for r in rows[0]):
            parts.append(f"{static}/{dynamic}: no {unit} under the fixed slice")
            continue
        reduction = paired_interval(
            rows[1], rows[0], lambda d, s, m=metric: 1 - d[m] / s[m] if s[m] else math.nan
        ).clip(*REDUCTION)
        parts.append(
            f"{static} -> {dynamic}: {show(rows[0], metric)} -> {show(rows[1], metric)} {unit}, "
            f"reduction {pct(reduction)} ({n_seeds(rows[0])})"
        )
        if verdict is None:  # the first pair that binds decides
            verdict = compare(reduction, 0.23 - 0.05, claimed="above") or INCONCLUSIVE
    if not parts:
        return missing(arms, *SLICE_PAIRS[1])
    return Finding("; ".join(parts), verdict or IDLE)


def save_restore_ms(arms: Arms) -> Finding:
    parts = []
    for name in ("swap_zstd", "swap_raw", "swap_mixed"):
        rows = paired(arms, name)
        if rows is not None and all(r["num_saves"] for r in rows[0]):
            r = rows[0]
            parts.append(f"{name} save {show(r, 'save_ms_p50')} ms, restore {show(r, 'restore_ms_p50')} ms")
    rows = paired(arms, "swap_zstd")
    if rows is None:
        return missing(arms, "swap_zstd")
    if not all(r["num_saves"] for r in rows[0]):
        return Finding("swap_zstd saved nothing in some seed", IDLE)
    decisions = []
    for key in ("save_ms_p50", "restore_ms_p50"):
        if all(not is_nan(r[key]) for r in rows[0]):
            iv = interval_of(rows[0], key)
            above, below = compare(iv, 5.0, claimed="above"), compare(iv, 15.0, claimed="below")
            decisions.append(NOT_HELD if NOT_HELD in (above, below) else all_of(above, below))
    measured = "; ".join(parts) + f" (median per run, mean over {n_seeds(rows[0])}, virtual clock)"
    return Finding(measured, all_of(*decisions))


def _lossy_real(arms: Arms, plan: str | None = None) -> list[dict[str, Any]] | None:
    """A swap_mixed arm without early saves on a backend with real KV and tokens."""
    for rows in arms.values():
        ok = [r for r in rows if r["status"] == "ok"]
        if not ok:
            continue
        cfg = ok[0]["_config"]
        if (
            cfg["preemption"]["mode"] == "swap_mixed"
            and cfg["early_save"]["policy"] == "none"
            and cfg["model"]["backend"] != "null"
            and (plan is None or cfg["preemption"]["codecs"].get("mixed", {}).get("plan", "random") == plan)
        ):
            return ok
    return None


def mixed_bytes(arms: Arms) -> Finding:
    parts = []
    modelled = paired(arms, "swap_mixed")
    if modelled and modelled[0][0]["_config"]["model"]["backend"] == "null" and modelled[0][0]["num_saves"]:
        parts.append(
            f"modelled (null backend, the head plan's sizes): {show(modelled[0], 'stored_over_raw')}x"
        )
        fp8 = paired(arms, "swap_fp8")
        if fp8 and fp8[0][0]["num_saves"]:
            parts.append(f"uniform FP8: {show(fp8[0], 'stored_over_raw')}x")
    real = _lossy_real(arms)
    if real is None or not all(r["num_saves"] for r in real):
        return Finding("; ".join(parts + ["no swap_mixed save on real KV (tiny/hf backend)"]), NOT_MEASURED)
    dtype = real[0]["_config"]["model"]["dtype"]
    ratio = interval_of(real, "stored_over_raw")
    parts.insert(0, f"{real[0]['arm']} on real {dtype} KV: stored/raw {fmt(ratio)} ({n_seeds(real)})")
    if DTYPE_BITS[dtype] != 16:
        # Kept heads stay in the cache's dtype and FP8 is 1 byte: against 32-bit KV the
        # ratio is not the 16-bit one, and no rescaling recovers it without the plan.
        return Finding("; ".join(parts) + " (not 16-bit KV: not comparable)", NOT_MEASURED)
    return Finding("; ".join(parts), compare(ratio, 0.65 + 0.05, claimed="below") or INCONCLUSIVE)


def warmup(arms: Arms) -> Finding:
    real = _lossy_real(arms)
    if real is None:
        return Finding("no swap_mixed arm with real tokens (tiny/hf backend)", NOT_MEASURED)
    if any(is_nan(r["token_agreement"]) for r in real):
        return Finding(f"{real[0]['arm']}: {real[0].get('quality_note') or 'no reference'}", NOT_MEASURED)
    warmup = real[0]["_config"]["preemption"]["warmup_tokens"]
    exact = interval_of(real, "exact_match_share")
    measured = (
        f"{real[0]['arm']} vs its lossless reference, {warmup} warm-up tokens: token agreement "
        f"{show(real, 'token_agreement', 4)}, identical outputs {fmt(exact)} "
        f"({sum(r['num_restores'] for r in real)} lossy restores, {n_seeds(real)})"
    )
    if not any(r["num_restores"] for r in real):
        return Finding(measured + "; no lossy restore happened", IDLE)
    return Finding(measured, compare(exact, 0.95, claimed="above") or INCONCLUSIVE)


def early_warning(arms: Arms) -> Finding:
    parent_rows = paired(arms, "swap_mixed")
    if parent_rows is None:
        return missing(arms, "swap_mixed")
    parent = parent_rows[0]
    parts = []
    for name in ("early_lstm", "early_rule", "early_always", "early_oracle", "early_forecast"):
        rows = paired(arms, "swap_mixed", name)
        if rows is None:
            continue
        base, r = rows
        change = pct(paired_interval(r, base, relative("preemption_stall_s")).clip(*RELATIVE_CHANGE))
        text = f"{name} stall {show(r, 'preemption_stall_s')} s ({change})"
        if not any(is_nan(x.get("early_save_precision", math.nan)) for x in r):
            precision, recall = interval_of(r, "early_save_precision"), interval_of(r, "early_save_recall")
            text += f", precision {fmt(precision, 2)} recall {fmt(recall, 2)}"
        parts.append(text)
    measured = f"swap_mixed stall {show(parent, 'preemption_stall_s')} s; " + "; ".join(parts)
    rows = paired(arms, "swap_mixed", "early_lstm")
    if rows is None:
        absent = missing(arms, "early_lstm")
        return Finding(f"{absent.measured}; {measured}", NOT_MEASURED)
    base, lstm = rows
    if same_metrics(base, lstm):
        return Finding(measured + "; early_lstm ran identically to swap_mixed: no early save", NOT_MEASURED)
    if not any(r["preemption_stall_s"] for r in base):
        return Finding(measured + "; no stall to hide", IDLE)
    diff = paired_interval(lstm, base, difference("preemption_stall_s"))
    return Finding(
        measured + f"; difference {fmt(diff)} s ({n_seeds(base)})",
        compare(diff, 0.0, claimed="below") or INCONCLUSIVE,
    )


# (uncapped, capped) twins that differ only in `max_preemption_per_min`: a cap binds on
# priority preemptions (`rate_limit_tight` on the quick load) or on time sharing's yields
RATE_PAIRS = (
    ("slices_dynamic", "rate_limit"),
    ("slices_dynamic", "rate_limit_tight"),
    ("time_share_uncapped", "time_share_dynamic"),
)


def rate_limit(arms: Arms) -> Finding:
    key = "peak_priority_preemptions_per_min"
    parts, binds, broken = [], False, False
    for uncapped, capped_name in RATE_PAIRS:
        rows = paired(arms, uncapped, capped_name)
        if rows is None:
            continue
        free, capped = rows
        cap = capped[0]["_config"]["preemption"]["max_preemption_per_min"]
        text = (
            f"{uncapped} -> {capped_name} (cap {cap}): peak priority preemptions per minute "
            f"{show(free, key)} -> {show(capped, key)} (max {max(r[key] for r in free)} -> "
            f"{max(r[key] for r in capped)}), goodput {show(free, 'goodput_req_s')} -> "
            f"{show(capped, 'goodput_req_s')} req/s ({n_seeds(free)})"
        )
        # A cap is a hard bound, not an average: it holds when no seed's capped run passes it.
        if any(r[key] > cap for r in capped):
            broken = True
        if any(r[key] > cap for r in free):
            binds = True
        else:
            text += "; the cap was never reached"
        parts.append(text)
    if not parts:
        return missing(arms, *RATE_PAIRS[0])
    verdict = NOT_HELD if broken else HELD if binds else IDLE
    return Finding("; ".join(parts), verdict)


# (swap, pause) twins on the same uncompressed path, so only the copies avoided differ
# (swap_zstd's stall is mostly zstd's). Time sharing first: its yields resume soon, before
# their blocks are needed, which is what a pause is for; the first pair that binds decides.
ZERO_COPY_PAIRS = (("time_share_swap", "time_share_dynamic"), ("swap_raw", "pause"))


def zero_copy(arms: Arms) -> Finding:
    parts, verdict = [], None
    for swap_name, pause_name in ZERO_COPY_PAIRS:
        rows = paired(arms, swap_name, pause_name)
        if rows is None:
            continue
        swap, pause = rows
        moved = paired_interval(pause, swap, difference("kv_bytes_moved"))
        stall = paired_interval(pause, swap, difference("preemption_stall_s"))
        text = (
            f"KV moved {show(swap, 'kv_bytes_moved', scale=1e-9)} GB ({swap_name}) vs "
            f"{show(pause, 'kv_bytes_moved', scale=1e-9)} GB ({pause_name}; "
            f"{sum(r['num_reclaims'] for r in pause)} reclaims over the seeds), difference "
            f"{fmt(moved, scale=1e-9)} GB; stall difference {fmt(stall)} s ({n_seeds(swap)})"
        )
        if not any(r["num_preemptions"] for r in pause):
            parts.append(text + "; no preemption")
            continue
        parts.append(text)
        if verdict is not None:
            continue
        # fewer bytes (interval below 0) and a stall that is not longer (interval not above 0)
        bytes_verdict = compare(moved, 0.0, claimed="below")
        stall_longer = compare(stall, 0.0, claimed="above") == HELD
        if bytes_verdict == NOT_HELD or stall_longer:
            verdict = NOT_HELD
        elif bytes_verdict == HELD and stall.is_defined and stall.lo <= 0:
            verdict = HELD
        else:
            verdict = INCONCLUSIVE
    if not parts:
        return missing(arms, *ZERO_COPY_PAIRS[1])
    return Finding("; ".join(parts), verdict or IDLE)


def _kv_wait(row: dict[str, Any]) -> float:
    """Time spent waiting on KV moves: the batch's stall plus, with asynchronous restores,
    the readmitted requests' own wait out of the batch (the cost moved, not removed)."""
    return row["preemption_stall_s"] + row["preemption_restore_wait_s"]


def _host_codec_on_critical_path(arms: Arms, codec: str) -> Finding:
    """The `swap_<codec>` arm against `swap_raw`, paired by seed: does its host time (encode
    on save, decode on restore) cost more KV wait than its smaller copies save?"""
    arm = f"swap_{codec}"
    rows = paired(arms, "swap_raw", arm)
    if rows is None:
        return missing(arms, "swap_raw", arm)
    raw, coded = rows
    diff = paired_interval(coded, raw, lambda x, y: _kv_wait(x) - _kv_wait(y))
    stall, wait = "preemption_stall_s", "preemption_restore_wait_s"
    measured = (
        f"stall {show(raw, stall)} s + restore wait {show(raw, wait)} s "
        f"(raw) vs {show(coded, stall)} s + {show(coded, wait)} s "
        f"({codec}), difference {fmt(diff)} s; goodput {show(raw, 'goodput_req_s')} vs "
        f"{show(coded, 'goodput_req_s')} req/s ({n_seeds(raw)})"
    )
    if not any(r["num_saves"] for r in coded):
        return Finding(measured + "; nothing saved", IDLE)
    return Finding(measured, compare(diff, 0.0, claimed="above") or INCONCLUSIVE)


def zstd_critical_path(arms: Arms) -> Finding:
    return _host_codec_on_critical_path(arms, "zstd")


def lz4_critical_path(arms: Arms) -> Finding:
    return _host_codec_on_critical_path(arms, "lz4")


def zstd_ratio(arms: Arms) -> Finding:
    for rows in arms.values():
        ok = [r for r in rows if r["status"] == "ok" and r["num_saves"]]
        if not ok:
            continue
        cfg = ok[0]["_config"]
        if cfg["preemption"]["mode"] != "swap_zstd" or cfg["model"]["backend"] == "null":
            continue
        ratio = t_interval([r["kv_saved_bytes_raw"] / r["kv_saved_bytes_stored"] for r in ok])
        model = cfg["model"]
        measured = f"{ok[0]['arm']}: {fmt(ratio)}x on {model['dtype']} KV of the {model['backend']} model"
        if DTYPE_BITS[model["dtype"]] != 16:
            return Finding(measured + " (not 16-bit KV: not comparable)", NOT_MEASURED)
        inside = all_of(compare(ratio, 1.05, claimed="above"), compare(ratio, 1.25, claimed="below"))
        return Finding(measured, inside)
    return Finding("no swap_zstd save on real KV (the null backend uses the configured ratio)", NOT_MEASURED)


# The metrics length knowledge is judged on: goodput and the top class's SLO attainment.
SHARE_METRICS = (("goodput_req_s", "goodput"), ("sla{top}_slo_attainment", "top-class SLO attainment"))
SHARE_TARGET = 0.5


def oracle_share(without: str, learned: str, oracle: str) -> Callable[[Arms], Finding]:
    """The share of the oracle's advantage over `without` (remaining work from max_tokens)
    that `learned` recovers: mean(learned - without) / mean(oracle - without), paired by
    seed, with Fieller's interval (preempt.obs.stats.ratio_interval). Per metric: held
    when the interval is above SHARE_TARGET, did not hold when below; a metric where the
    oracle's own advantage is not clear of 0 decides nothing."""

    def evaluate(arms: Arms) -> Finding:
        rows = paired(arms, without, learned, oracle)
        if rows is None:
            return missing(arms, without, learned, oracle)
        base, mid, best = rows
        top = top_level(base)
        parts, decisions = [], []
        for template, label in SHARE_METRICS:
            key = template.format(top=top)
            gain = paired_interval(best, base, difference(key))
            share = ratio_interval(
                [m[key] - b[key] for m, b in zip(mid, base, strict=True)],
                [o[key] - b[key] for o, b in zip(best, base, strict=True)],
            )
            text = f"{label}: oracle - {without} {fmt(gain)}"
            if compare(gain, 0.0, claimed="above") != HELD:
                point = f" (share of the means {share.mean:.2g})" if math.isfinite(share.mean) else ""
                parts.append(
                    text + f"; the oracle's advantage is not clear of 0, so no share is judged{point}"
                )
                continue
            shown = fmt(share) if share.is_defined else f"{share.mean:.3g} (no bounded interval)"
            parts.append(text + f"; share recovered by {learned} {shown}")
            decisions.append(compare(share, SHARE_TARGET, claimed="above"))
        measured = "; ".join(parts) + f" ({n_seeds(base)})"
        if not decisions:
            return Finding(measured, IDLE)
        return Finding(measured, all_of(*decisions))

    return evaluate


# ---------------------------------------------------------------- from a benchmark's JSON


CODEC_PLAN, CODEC_BASELINE = "budget_sensitivity", "fp8"


def codec_budget(result: dict[str, Any]) -> Finding:
    """`preempt bench codec`'s sensitivity plan against uniform FP8, paired by prompt: the
    greedy agreement difference (plan - fp8) above 0 and the KL difference below 0 hold;
    either interval on its wrong side, or a plan not smaller than both the budget and FP8,
    does not hold."""
    plans = result.get("plans", {})
    absent = [name for name in (CODEC_PLAN, CODEC_BASELINE) if name not in plans]
    if absent:
        return Finding(
            f"no plan {', '.join(absent)} in the codec result (the budget plans need a trained LM: --model)",
            NOT_MEASURED,
        )
    plan, fp8 = plans[CODEC_PLAN], plans[CODEC_BASELINE]
    if "per_prompt" not in plan or "per_prompt" not in fp8:
        return Finding("no per-prompt values in the codec result (from before they were kept)", NOT_MEASURED)
    diffs = {
        key: t_interval([a - b for a, b in zip(plan["per_prompt"][key], fp8["per_prompt"][key], strict=True)])
        for key in ("greedy_agreement", "kl_mean", "top1_agreement")
    }
    agreement, kl = diffs["greedy_agreement"], diffs["kl_mean"]
    target = result.get("budget", {}).get("target_size_vs_fp16", math.inf)
    size, fp8_size = plan["size_vs_fp16"], fp8["size_vs_fp16"]
    measured = (
        f"size {size:.3f}x vs {fp8_size:.3f}x of FP16 (budget {target:g}x); greedy agreement "
        f"{plan['greedy_agreement']:.3g} vs {fp8['greedy_agreement']:.3g}, difference {fmt(agreement)}; "
        f"KL {plan['kl_mean']:.3g} vs {fp8['kl_mean']:.3g} nats, difference {fmt(kl)}; top-1 difference "
        f"{fmt(diffs['top1_agreement'])} (n={agreement.num} prompts, one trained LM)"
    )
    if not size <= min(target, fp8_size):
        return Finding(measured + "; the plan is not within the budget and smaller than FP8", NOT_HELD)
    return Finding(
        measured, all_of(compare(agreement, 0.0, claimed="above"), compare(kl, 0.0, claimed="below"))
    )
