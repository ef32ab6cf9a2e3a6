"""The claims we test and how each is measured: the article's numbers (docs/design.md
§1-§9) and the field's facts we measure ourselves against, each with the arms it compares,
the metric, the tolerance and a verdict from 95% intervals (`CLAIMS`). Rendering them is
experiments.report's.

Must never: hold a number typed by hand (everything comes from `results.csv` and
`ablation.json`), or call a claim held when the arms it needs did not run, did nothing
(same metrics as their parent) or saw no event to judge by: those are "not measured by
this run" or "idle" (the mechanism never acted at that point), with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from experiments.dominance import (
    DESIGN_ARMS,
    OBJECTIVES,
    WORSE,
    Arms,
    compare_arms,
    is_baseline,
    paired,
    paired_interval,
    top_level,
)
from experiments.stats import Interval, compare, metric_range, ratio_interval, t_interval
from experiments.tables import metric_fingerprint

HELD, NOT_HELD, INCONCLUSIVE, IDLE, NOT_MEASURED = (
    "held",
    "did not hold",
    "inconclusive",
    # The arms ran but the mechanism never acted (no priority preemption, a cap never
    # reached, a slice that never decided): no evidence either way, and not noise either.
    "idle",
    "not measured by this run",
)
DTYPE_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}


@dataclass(frozen=True)
class Finding:
    measured: str
    verdict: str


@dataclass(frozen=True)
class Claim:
    key: str
    source: str  # where the claim comes from (a docs/design.md section or field fact)
    text: str
    method: str  # how this report measures it
    evaluate: Callable[[Arms], Finding]
    regime: str = ""  # where its mechanism binds (docs/regimes.md), when the quick load is not it


def _missing(arms: Arms, *names: str) -> Finding:
    absent = [n for n in names if n not in arms]
    if absent:
        return Finding(f"needs arm(s) {', '.join(absent)}", NOT_MEASURED)
    parts = []
    for n in names:
        bad = [r for r in arms[n] if r["status"] != "ok"]
        if bad:
            parts.append(f"{n} {bad[0]['status']}: {bad[0].get('notes') or ''}".strip())
    return Finding("; ".join(parts) or "no seed ran in every arm", NOT_MEASURED)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Identical metrics in every seed: the change never decided anything."""
    return all(metric_fingerprint(x) == metric_fingerprint(y) for x, y in zip(a, b, strict=True))


def _iv(rows: list[dict[str, Any]], metric: str) -> Interval:
    return t_interval([float(r[metric]) for r in rows], bounds=metric_range(metric))


def _f(iv: Interval, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    return iv.format(digits, scale, unit)


# What a relative change of non-negative metrics can take: `a / b - 1` is at least -100%,
# a reduction `1 - a / b` at most 100% (the mean of per-seed ratios too, so the interval is
# clipped to it like a metric's; experiments.stats).
RELATIVE_CHANGE = (-1.0, math.inf)
REDUCTION = (-math.inf, 1.0)


def _pct_iv(iv: Interval) -> str:
    if not iv.is_defined:
        return f"{iv.mean * 100:+.1f}% (n={iv.num}, no interval)"
    return f"{iv.mean * 100:+.1f}% [{iv.lo * 100:+.1f}%, {iv.hi * 100:+.1f}%]"


def _verdict(*decisions: str | None) -> str:
    """Several interval checks that must all hold: any 'did not hold' decides; all 'held'
    hold; anything else is inconclusive."""
    if NOT_HELD in decisions:
        return NOT_HELD
    if decisions and all(d == HELD for d in decisions):
        return HELD
    return INCONCLUSIVE


def _n(rows: list[dict[str, Any]]) -> str:
    return f"n={len(rows)} seeds"


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _rel(metric: str) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    def fn(x: dict[str, Any], y: dict[str, Any]) -> float:
        return x[metric] / y[metric] - 1 if y[metric] else math.nan

    return fn


def _diff(metric: str) -> Callable[[dict[str, Any], dict[str, Any]], float]:
    return lambda x, y: x[metric] - y[metric]


# ---------------------------------------------------------------- the claims


def _threshold(arms: Arms) -> Finding:
    names = ("threshold_0", "score", "threshold_50")
    rows = paired(arms, *names)
    if rows is None:
        return _missing(arms, *names)
    zero, score, fifty = rows
    top = top_level(score)
    parts = [
        f"goodput {_f(_iv(zero, 'goodput_req_s'))} / {_f(_iv(score, 'goodput_req_s'))} / "
        f"{_f(_iv(fifty, 'goodput_req_s'))} req/s at margins 0 / 0.2 / 0.5",
        f"level-{top} TTFT p99 {_f(_iv(score, f'sla{top}_ttft_p99_s'))} s at 0.2",
    ]
    if _same(zero, score) and _same(score, fifty):
        return Finding("; ".join(parts) + f"; the margin changed nothing ({_n(score)})", IDLE)
    decisions = []
    for name, other in (("0", zero), ("0.5", fifty)):
        rel = paired_interval(score, other, _rel("goodput_req_s")).clip(*RELATIVE_CHANGE)
        parts.append(f"0.2 vs {name}: {_pct_iv(rel)}")
        decisions.append(compare(rel, -0.01, claimed="above"))
    return Finding("; ".join(parts) + f" ({_n(score)})", _verdict(*decisions))


def _top_ttft(arms: Arms, baseline: str, arm: str) -> tuple[list, list, str, str] | Finding:
    """`baseline`'s and `arm`'s rows paired by seed, the top SLA level and its TTFT p99
    column; or the Finding saying which arm is missing."""
    rows = paired(arms, baseline, arm)
    if rows is None:
        return _missing(arms, baseline, arm)
    top = top_level(rows[1])
    return rows[0], rows[1], top, f"sla{top}_ttft_p99_s"


def _top_class_ttft(arms: Arms, baseline: str) -> Finding:
    """The top SLA level's TTFT p99 under `score` minus under `baseline`, paired by seed:
    the claim holds when the interval is below 0."""
    found = _top_ttft(arms, baseline, "score")
    if isinstance(found, Finding):
        return found
    base, score, top, key = found
    diff = paired_interval(score, base, _diff(key))
    measured = (
        f"level-{top} TTFT p99 {_f(_iv(base, key))} s ({baseline}) -> {_f(_iv(score, key))} s (score); "
        f"difference {_f(diff)} s ({_n(score)})"
    )
    if not any(r["num_priority_preemptions"] for r in score):
        return Finding(measured + "; no priority preemption happened", IDLE)
    return Finding(measured, compare(diff, 0.0, claimed="below") or INCONCLUSIVE)


def _vip(arms: Arms) -> Finding:
    # Protection is against the same engine without priority: FCFS admission, preemption
    # only when blocks run out (`vllm_fcfs`, the parent of `score`'s chain).
    return _top_class_ttft(arms, "vllm_fcfs")


# How much worse than strict priority the top class's TTFT p99 may be and still count as
# protected "as well": a non-inferiority margin, relative to strict priority's.
STRICT_MARGIN = 0.10


def _as_strict(arm: str) -> Callable[[Arms], Finding]:
    """`arm`'s top-class TTFT p99 against `vllm_priority`'s, paired by seed
    (non-inferiority): `arm` - (1 + STRICT_MARGIN) x `vllm_priority`, in seconds, below 0.
    A difference, not a ratio: the mean of per-seed ratios has no upper bound, and one seed
    whose strict-priority TTFT is near 0 makes its interval span thousands of percent."""

    def evaluate(arms: Arms) -> Finding:
        found = _top_ttft(arms, "vllm_priority", arm)
        if isinstance(found, Finding):
            return found
        strict, design, top, key = found
        excess = paired_interval(design, strict, lambda x, y: x[key] - (1 + STRICT_MARGIN) * y[key])
        measured = (
            f"level-{top} TTFT p99 {_f(_iv(strict, key))} s (vllm_priority) -> {_f(_iv(design, key))} s "
            f"({arm}); {arm} - {1 + STRICT_MARGIN:g} x vllm_priority {_f(excess)} s ({_n(design)})"
        )
        if _same(design, strict) and all(x[key] == y[key] for x, y in zip(design, strict, strict=True)):
            return Finding(measured + f"; {arm} ran as strict priority in every seed", IDLE)
        return Finding(measured, compare(excess, 0.0, claimed="below") or INCONCLUSIVE)

    return evaluate


def _front(arm: str) -> Callable[[Arms], Finding]:
    """`arm` against every named baseline present (experiments.dominance): held when it is
    better than each on one of the OBJECTIVES (paired intervals), did not hold when one
    dominates it."""

    def evaluate(arms: Arms) -> Finding:
        baselines = [name for name in arms if is_baseline(name)]
        if arm not in arms or not baselines:
            return _missing(arms, arm, *(baselines or ["vllm_priority"]))
        comparisons = [c for b in baselines if (c := compare_arms(arms, b, arm)) is not None]
        if not comparisons:
            return _missing(arms, arm, *baselines)
        parts = []
        for c in comparisons:
            diffs = ", ".join(f"{o.label} {_f(d)}" for o, d in zip(OBJECTIVES, c.diffs, strict=True))
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


def design_claims(arm: str) -> list[Claim]:
    """The two claims on where `arm` stands among policies (`preempt report --compare ARM`
    adds them for a user's own arm)."""
    keys = {"score": ("front", "priority_vs_strict")}.get(arm, (f"front_{arm}", f"strict_{arm}"))
    return [
        Claim(
            keys[0],
            "leaderboard",
            f"`{arm}` is not dominated by any named baseline (goodput; the top class's TTFT p99 and SLO "
            "attainment)",
            f"each named baseline (vllm_*, sglang_*, fastserve_*) - `{arm}` on goodput and the top SLA "
            "level's TTFT p99 and SLO attainment, paired by seed: held when every baseline is worse on "
            "one of them (interval on the bad side), did not hold when one is better on one and worse "
            "on none",
            _front(arm),
            regime="every load.yaml, sla.yaml and pool.yaml point (docs/leaderboard.md)",
        ),
        Claim(
            keys[1],
            "field",
            f"`{arm}` protects the top class as well as strict priority (`vllm_priority`)",
            f"top SLA level's TTFT p99 of `{arm}` - {1 + STRICT_MARGIN:g} x `vllm_priority`'s (at most "
            f"{STRICT_MARGIN:.0%} worse), paired by seed, in s: interval below 0 (non-inferiority) held, "
            "above did not hold",
            _as_strict(arm),
            regime="queues: load.yaml from 1x, sla.yaml",
        ),
    ]


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


def _dynamic_slices(arms: Arms) -> Finding:
    parts, verdict = [], None
    for static, dynamic in SLICE_PAIRS:
        rows = paired(arms, static, dynamic)
        if rows is None:
            continue
        metric, unit = _overhead_metric(rows[0][0])
        if _same(*rows):
            parts.append(f"{static} and {dynamic} ran identically in every seed: the slice never decided")
            continue
        if not any(r[metric] for r in rows[0]):
            parts.append(f"{static}/{dynamic}: no {unit} under the fixed slice")
            continue
        reduction = paired_interval(
            rows[1], rows[0], lambda d, s, m=metric: 1 - d[m] / s[m] if s[m] else math.nan
        ).clip(*REDUCTION)
        parts.append(
            f"{static} -> {dynamic}: {_f(_iv(rows[0], metric))} -> {_f(_iv(rows[1], metric))} {unit}, "
            f"reduction {_pct_iv(reduction)} ({_n(rows[0])})"
        )
        if verdict is None:  # the first pair that binds decides
            verdict = compare(reduction, 0.23 - 0.05, claimed="above") or INCONCLUSIVE
    if not parts:
        return _missing(arms, *SLICE_PAIRS[1])
    return Finding("; ".join(parts), verdict or IDLE)


def _save_restore_ms(arms: Arms) -> Finding:
    parts = []
    for name in ("swap_zstd", "swap_raw", "swap_mixed"):
        rows = paired(arms, name)
        if rows is not None and all(r["num_saves"] for r in rows[0]):
            r = rows[0]
            parts.append(
                f"{name} save {_f(_iv(r, 'save_ms_p50'))} ms, restore {_f(_iv(r, 'restore_ms_p50'))} ms"
            )
    rows = paired(arms, "swap_zstd")
    if rows is None:
        return _missing(arms, "swap_zstd")
    if not all(r["num_saves"] for r in rows[0]):
        return Finding("swap_zstd saved nothing in some seed", IDLE)
    decisions = []
    for key in ("save_ms_p50", "restore_ms_p50"):
        if all(not _nan(r[key]) for r in rows[0]):
            iv = _iv(rows[0], key)
            above, below = compare(iv, 5.0, claimed="above"), compare(iv, 15.0, claimed="below")
            decisions.append(NOT_HELD if NOT_HELD in (above, below) else _verdict(above, below))
    measured = "; ".join(parts) + f" (median per run, mean over {_n(rows[0])}, virtual clock)"
    return Finding(measured, _verdict(*decisions))


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
            and (plan is None or cfg["preemption"]["head_plan"] == plan)
        ):
            return ok
    return None


def _mixed_bytes(arms: Arms) -> Finding:
    parts = []
    modelled = paired(arms, "swap_mixed")
    if modelled and modelled[0][0]["_config"]["model"]["backend"] == "null" and modelled[0][0]["num_saves"]:
        parts.append(
            f"modelled (null backend, the head plan's sizes): {_f(_iv(modelled[0], 'stored_over_raw'))}x"
        )
        fp8 = paired(arms, "swap_fp8")
        if fp8 and fp8[0][0]["num_saves"]:
            parts.append(f"uniform FP8: {_f(_iv(fp8[0], 'stored_over_raw'))}x")
    real = _lossy_real(arms)
    if real is None or not all(r["num_saves"] for r in real):
        return Finding("; ".join(parts + ["no swap_mixed save on real KV (tiny/hf backend)"]), NOT_MEASURED)
    dtype = real[0]["_config"]["model"]["dtype"]
    ratio = _iv(real, "stored_over_raw")
    parts.insert(0, f"{real[0]['arm']} on real {dtype} KV: stored/raw {_f(ratio)} ({_n(real)})")
    if DTYPE_BITS[dtype] != 16:
        # Kept heads stay in the cache's dtype and FP8 is 1 byte: against 32-bit KV the
        # ratio is not the 16-bit one, and no rescaling recovers it without the plan.
        return Finding("; ".join(parts) + " (not 16-bit KV: not comparable)", NOT_MEASURED)
    return Finding("; ".join(parts), compare(ratio, 0.65 + 0.05, claimed="below") or INCONCLUSIVE)


def _warmup(arms: Arms) -> Finding:
    real = _lossy_real(arms)
    if real is None:
        return Finding("no swap_mixed arm with real tokens (tiny/hf backend)", NOT_MEASURED)
    if any(_nan(r["token_agreement"]) for r in real):
        return Finding(f"{real[0]['arm']}: {real[0].get('quality_note') or 'no reference'}", NOT_MEASURED)
    warmup = real[0]["_config"]["preemption"]["warmup_tokens"]
    exact = _iv(real, "exact_match_share")
    measured = (
        f"{real[0]['arm']} vs its lossless reference, {warmup} warm-up tokens: token agreement "
        f"{_f(_iv(real, 'token_agreement'), 4)}, identical outputs {_f(exact)} "
        f"({sum(r['num_restores'] for r in real)} lossy restores, {_n(real)})"
    )
    if not any(r["num_restores"] for r in real):
        return Finding(measured + "; no lossy restore happened", IDLE)
    return Finding(measured, compare(exact, 0.95, claimed="above") or INCONCLUSIVE)


def _early_warning(arms: Arms) -> Finding:
    parent_rows = paired(arms, "swap_mixed")
    if parent_rows is None:
        return _missing(arms, "swap_mixed")
    parent = parent_rows[0]
    parts = []
    for name in ("early_lstm", "early_rule", "early_always", "early_oracle", "early_forecast"):
        rows = paired(arms, "swap_mixed", name)
        if rows is None:
            continue
        base, r = rows
        change = _pct_iv(paired_interval(r, base, _rel("preemption_stall_s")).clip(*RELATIVE_CHANGE))
        text = f"{name} stall {_f(_iv(r, 'preemption_stall_s'))} s ({change})"
        if not any(_nan(x.get("early_save_precision", math.nan)) for x in r):
            precision, recall = _iv(r, "early_save_precision"), _iv(r, "early_save_recall")
            text += f", precision {_f(precision, 2)} recall {_f(recall, 2)}"
        parts.append(text)
    measured = f"swap_mixed stall {_f(_iv(parent, 'preemption_stall_s'))} s; " + "; ".join(parts)
    rows = paired(arms, "swap_mixed", "early_lstm")
    if rows is None:
        missing = _missing(arms, "early_lstm")
        return Finding(f"{missing.measured}; {measured}", NOT_MEASURED)
    base, lstm = rows
    if _same(base, lstm):
        return Finding(measured + "; early_lstm ran identically to swap_mixed: no early save", NOT_MEASURED)
    if not any(r["preemption_stall_s"] for r in base):
        return Finding(measured + "; no stall to hide", IDLE)
    diff = paired_interval(lstm, base, _diff("preemption_stall_s"))
    return Finding(
        measured + f"; difference {_f(diff)} s ({_n(base)})",
        compare(diff, 0.0, claimed="below") or INCONCLUSIVE,
    )


# (uncapped, capped) twins that differ only in `max_preemption_per_min`: a cap binds on
# priority preemptions (`rate_limit_tight` on the quick load) or on time sharing's yields
RATE_PAIRS = (
    ("slices_dynamic", "rate_limit"),
    ("slices_dynamic", "rate_limit_tight"),
    ("time_share_uncapped", "time_share_dynamic"),
)


def _rate_limit(arms: Arms) -> Finding:
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
            f"{_f(_iv(free, key))} -> {_f(_iv(capped, key))} (max {max(r[key] for r in free)} -> "
            f"{max(r[key] for r in capped)}), goodput {_f(_iv(free, 'goodput_req_s'))} -> "
            f"{_f(_iv(capped, 'goodput_req_s'))} req/s ({_n(free)})"
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
        return _missing(arms, *RATE_PAIRS[0])
    verdict = NOT_HELD if broken else HELD if binds else IDLE
    return Finding("; ".join(parts), verdict)


# (swap, pause) twins on the same uncompressed path, so only the copies avoided differ
# (swap_zstd's stall is mostly zstd's). Time sharing first: its yields resume soon, before
# their blocks are needed, which is what a pause is for; the first pair that binds decides.
ZERO_COPY_PAIRS = (("time_share_swap", "time_share_dynamic"), ("swap_raw", "pause"))


def _zero_copy(arms: Arms) -> Finding:
    parts, verdict = [], None
    for swap_name, pause_name in ZERO_COPY_PAIRS:
        rows = paired(arms, swap_name, pause_name)
        if rows is None:
            continue
        swap, pause = rows
        moved = paired_interval(pause, swap, _diff("kv_bytes_moved"))
        stall = paired_interval(pause, swap, _diff("preemption_stall_s"))
        text = (
            f"KV moved {_f(_iv(swap, 'kv_bytes_moved'), scale=1e-9)} GB ({swap_name}) vs "
            f"{_f(_iv(pause, 'kv_bytes_moved'), scale=1e-9)} GB ({pause_name}; "
            f"{sum(r['num_reclaims'] for r in pause)} reclaims over the seeds), difference "
            f"{_f(moved, scale=1e-9)} GB; stall difference {_f(stall)} s ({_n(swap)})"
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
        return _missing(arms, *ZERO_COPY_PAIRS[1])
    return Finding("; ".join(parts), verdict or IDLE)


def _kv_wait(row: dict[str, Any]) -> float:
    """Time spent waiting on KV moves: the batch's stall plus, with asynchronous restores,
    the readmitted requests' own wait out of the batch (the cost moved, not removed)."""
    return row["preemption_stall_s"] + row["preemption_restore_wait_s"]


def _zstd_critical_path(arms: Arms) -> Finding:
    rows = paired(arms, "swap_raw", "swap_zstd")
    if rows is None:
        return _missing(arms, "swap_raw", "swap_zstd")
    raw, zstd = rows
    diff = paired_interval(zstd, raw, lambda x, y: _kv_wait(x) - _kv_wait(y))
    stall, wait = "preemption_stall_s", "preemption_restore_wait_s"
    measured = (
        f"stall {_f(_iv(raw, stall))} s + restore wait {_f(_iv(raw, wait))} s "
        f"(raw) vs {_f(_iv(zstd, stall))} s + {_f(_iv(zstd, wait))} s "
        f"(zstd), difference {_f(diff)} s; goodput {_f(_iv(raw, 'goodput_req_s'))} vs "
        f"{_f(_iv(zstd, 'goodput_req_s'))} req/s ({_n(raw)})"
    )
    if not any(r["num_saves"] for r in zstd):
        return Finding(measured + "; nothing saved", IDLE)
    return Finding(measured, compare(diff, 0.0, claimed="above") or INCONCLUSIVE)


def _zstd_ratio(arms: Arms) -> Finding:
    for rows in arms.values():
        ok = [r for r in rows if r["status"] == "ok" and r["num_saves"]]
        if not ok:
            continue
        cfg = ok[0]["_config"]
        if cfg["preemption"]["mode"] != "swap_zstd" or cfg["model"]["backend"] == "null":
            continue
        ratio = t_interval([r["kv_saved_bytes_raw"] / r["kv_saved_bytes_stored"] for r in ok])
        model = cfg["model"]
        measured = f"{ok[0]['arm']}: {_f(ratio)}x on {model['dtype']} KV of the {model['backend']} model"
        if DTYPE_BITS[model["dtype"]] != 16:
            return Finding(measured + " (not 16-bit KV: not comparable)", NOT_MEASURED)
        inside = _verdict(compare(ratio, 1.05, claimed="above"), compare(ratio, 1.25, claimed="below"))
        return Finding(measured, inside)
    return Finding("no swap_zstd save on real KV (the null backend uses the configured ratio)", NOT_MEASURED)


# The metrics length knowledge is judged on: goodput and the top class's SLO attainment.
SHARE_METRICS = (("goodput_req_s", "goodput"), ("sla{top}_slo_attainment", "top-class SLO attainment"))
SHARE_TARGET = 0.5


def _oracle_share(without: str, learned: str, oracle: str) -> Callable[[Arms], Finding]:
    """The share of the oracle's advantage over `without` (remaining work from max_tokens)
    that `learned` recovers: mean(learned - without) / mean(oracle - without), paired by
    seed, with Fieller's interval (experiments.stats.ratio_interval). Per metric: held
    when the interval is above SHARE_TARGET, did not hold when below; a metric where the
    oracle's own advantage is not clear of 0 decides nothing."""

    def evaluate(arms: Arms) -> Finding:
        rows = paired(arms, without, learned, oracle)
        if rows is None:
            return _missing(arms, without, learned, oracle)
        base, mid, best = rows
        top = top_level(base)
        parts, decisions = [], []
        for template, label in SHARE_METRICS:
            key = template.format(top=top)
            gain = paired_interval(best, base, _diff(key))
            share = ratio_interval(
                [m[key] - b[key] for m, b in zip(mid, base, strict=True)],
                [o[key] - b[key] for o, b in zip(best, base, strict=True)],
            )
            text = f"{label}: oracle - {without} {_f(gain)}"
            if compare(gain, 0.0, claimed="above") != HELD:
                point = f" (share of the means {share.mean:.2g})" if math.isfinite(share.mean) else ""
                parts.append(
                    text + f"; the oracle's advantage is not clear of 0, so no share is judged{point}"
                )
                continue
            shown = _f(share) if share.is_defined else f"{share.mean:.3g} (no bounded interval)"
            parts.append(text + f"; share recovered by {learned} {shown}")
            decisions.append(compare(share, SHARE_TARGET, claimed="above"))
        measured = "; ".join(parts) + f" ({_n(base)})"
        if not decisions:
            return Finding(measured, IDLE)
        return Finding(measured, _verdict(*decisions))

    return evaluate


def share_claim(without: str, learned: str, oracle: str) -> Claim:
    return Claim(
        f"oracle_share_{without}",
        "docs/design.md §1",
        f"The learned estimate of the remaining output recovers at least half of what true output "
        f"lengths are worth to `{without}` (goodput; the top class's SLO attainment)",
        f"(`{learned}` - `{without}`) / (`{oracle}` - `{without}`) per metric, means paired by seed, "
        f"Fieller's 95% interval: above {SHARE_TARGET:g} held, below did not hold; a metric where the "
        "oracle's advantage is not clear of 0 is not judged",
        _oracle_share(without, learned, oracle),
        regime="memory pressure with a loose cap: the lengths sweep at 4x (15 seeds; the oracle's "
        "own advantage is not clear of 0 at most points)",
    )


DESIGN_CLAIMS: list[Claim] = [claim for arm in DESIGN_ARMS for claim in design_claims(arm)]

CLAIMS: list[Claim] = [
    Claim(
        "threshold",
        "docs/design.md §1",
        "A challenger must beat the running request's score by 20% (the default margin)",
        "goodput of `score` (margin 0.2) over margins 0 and 0.5, paired by seed: both intervals above -1% "
        "(held), one below (did not hold)",
        _threshold,
        regime="wherever priority preemptions happen: the quick load, load.yaml from 1x",
    ),
    Claim(
        "priority",
        "docs/design.md §1",
        "Priority-score preemption protects the most important class",
        "top SLA level's TTFT p99, `score` - `vllm_fcfs` (the same engine without priority) paired by "
        "seed: interval below 0",
        _vip,
        regime="queues: load.yaml from 1x (verdict per load point with `--sweep runs/load`)",
    ),
    *DESIGN_CLAIMS,
    share_claim("score", "score_learned", "score_oracle"),
    share_claim("score_tuned", "score_tuned_learned", "score_tuned_oracle"),
    Claim(
        "dynamic_slices",
        "docs/design.md §3",
        "Dynamic time slices cut preemption overhead by 23% against a fixed slice",
        "overhead (stall; recomputed tokens in recompute mode) of a dynamic-slice arm vs its fixed-slice "
        "twin, paired reduction interval above 18% (23% - 5 points); the first pair that binds decides: "
        "`time_share_static`/`_dynamic` (slices decide who runs), the same uncapped, "
        "`swap_zstd_static`/`swap_zstd`, "
        "`score`/`slices_dynamic`",
        _dynamic_slices,
        regime="time sharing (`time_share_static` vs `time_share_dynamic`): the slice decides who runs",
    ),
    Claim(
        "save_restore_ms",
        "docs/design.md §2",
        "Saving and restoring a request's KV costs 5-15 ms",
        "median save and restore time of `swap_zstd`, intervals inside [5, 15] ms (virtual clock: the "
        "target's KV over PCIe plus the calibrated codec throughput; wall-clock codec numbers: "
        "docs/benchmarks.md)",
        _save_restore_ms,
        regime="raw saves of long contexts or over shared links (regimes.yaml); zstd saves never: "
        "the codec sets their time",
    ),
    Claim(
        "mixed_bytes",
        "docs/design.md §9",
        "Mixed-precision saves (FP16/FP8/drop per head) are 35% smaller",
        "stored / raw bytes of a `swap_mixed` arm on real 16-bit KV, interval below 0.70x (the null "
        "backend's sizes follow the head plan by construction and are shown, not judged)",
        _mixed_bytes,
        regime="16-bit KV: quick's bfloat16 tiny arms",
    ),
    Claim(
        "warmup",
        "docs/design.md §9",
        "After a mixed-precision restore, 1-2 tokens of warm-up keep the output",
        "share of requests whose greedy outputs under a `swap_mixed` arm with real tokens equal the "
        "lossless reference's: interval above 0.95",
        _warmup,
        regime="quick's tiny arms (lossy restores in every seed)",
    ),
    Claim(
        "early_warning",
        "docs/design.md §8",
        "Predicting preemptions 50 ms ahead lets the KV save overlap compute",
        "stall of `early_lstm` - its parent `swap_mixed`, paired by seed: interval below 0 (rule, always "
        "and oracle shown)",
        _early_warning,
        regime="where stall is a real share of time: zstd saves, long contexts, shared links "
        "(docs/regimes.md)",
    ),
    Claim(
        "rate_limit",
        "docs/design.md §6",
        "max_preemption_per_min bounds preemption thrashing",
        "peak priority preemptions in any 60 s window of a capped arm at most its cap in every seed (a "
        "hard bound), where its uncapped twin exceeds it in some seed; twins: `slices_dynamic` / "
        "`rate_limit` (cap 30) and `rate_limit_tight` (cap 8), `time_share_uncapped` / "
        "`time_share_dynamic` (cap 30 on time sharing's yields)",
        _rate_limit,
        regime="time sharing (every yield is a priority preemption) and a cap under the uncapped "
        "peak: quick's `rate_limit_tight`, load.yaml from 1x",
    ),
    Claim(
        "zero_copy",
        "docs/design.md §4",
        "A zero-copy pause resumes without moving KV",
        "KV bytes moved by a pausing arm minus its raw-swap twin (same uncompressed path), paired by "
        "seed: interval below 0, and the stall difference's interval not above 0; the first pair that "
        "preempts decides: `time_share_dynamic` / `time_share_swap` (yields resume soon), `pause` / "
        "`swap_raw`",
        _zero_copy,
        regime="preempted requests that resume before their blocks are needed: time sharing's yields",
    ),
    Claim(
        "zstd_critical_path",
        "field",
        "CPU zstd (~350 MB/s per core) is ~100x slower than the PCIe copy: on the critical path it "
        "costs more than it saves",
        "time waiting on KV (the batch's stall + readmitted requests' wait for an asynchronous "
        "restore) of `swap_zstd` - `swap_raw`, paired by seed: interval above 0",
        _zstd_critical_path,
        regime="every regime with saves (regimes.yaml)",
    ),
    Claim(
        "zstd_ratio",
        "field",
        "zstd level 3 compresses FP16 KV only ~1.09-1.18x",
        "raw / stored bytes of a `swap_zstd` arm on real 16-bit KV, interval inside [1.05, 1.25]",
        _zstd_ratio,
        regime="16-bit KV: quick's bfloat16 tiny arms",
    ),
]


# ---------------------------------------------------------------- benchmarks' claims


@dataclass(frozen=True)
class BenchClaim:
    """A claim judged from a benchmark's JSON (what `preempt bench NAME --json` prints), not
    from an ablation's arms: one verdict per report. `bench`: the benchmark's name (the
    report's `--NAME PATH` flag); `missing` says how to measure it when the report was given
    no such JSON."""

    bench: str
    key: str
    source: str
    text: str
    method: str
    evaluate: Callable[[dict[str, Any]], Finding]
    missing: str

    def judge(self, result: dict[str, Any] | None) -> Finding:
        if result is None:
            return Finding(self.missing, NOT_MEASURED)
        return self.evaluate(result)


CODEC_PLAN, CODEC_BASELINE = "budget_sensitivity", "fp8"


def _codec_budget(result: dict[str, Any]) -> Finding:
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
        f"{plan['greedy_agreement']:.3g} vs {fp8['greedy_agreement']:.3g}, difference {_f(agreement)}; "
        f"KL {plan['kl_mean']:.3g} vs {fp8['kl_mean']:.3g} nats, difference {_f(kl)}; top-1 difference "
        f"{_f(diffs['top1_agreement'])} (n={agreement.num} prompts, one trained LM)"
    )
    if not size <= min(target, fp8_size):
        return Finding(measured + "; the plan is not within the budget and smaller than FP8", NOT_HELD)
    return Finding(
        measured, _verdict(compare(agreement, 0.0, claimed="above"), compare(kl, 0.0, claimed="below"))
    )


BENCH_CLAIMS: list[BenchClaim] = [
    BenchClaim(
        "codec",
        "codec_budget",
        "docs/codec.md (issue #17)",
        "The sensitivity plan (budget 0.35x of FP16) keeps the output better than uniform FP8 at a "
        "smaller size",
        "`preempt bench codec` on the trained LM: `budget_sensitivity` - `fp8` per held-out prompt, "
        "greedy agreement of the 64 tokens after a restore and mean KL of their distributions, "
        "t-intervals over the prompts (one trained LM: the spread between LM training seeds is not in "
        "them). Held when agreement's interval is above 0 and KL's below 0 (better on both, as the "
        "claim says; FP8's quality or better, the budget's target, then follows), did not hold when "
        "either is on its wrong side or the plan is not within the budget and smaller than FP8",
        _codec_budget,
        "no codec result: `preempt bench codec --json --model runs/lm/lm.pt > codec.json`, then "
        "`preempt report --codec codec.json`",
    ),
]

# ---------------------------------------------------------------- sources
