"""Confidence intervals for sweep metrics: Student-t over seeds, bootstrap for percentiles.

Owns: the 95% intervals every sweep table, plot and verdict uses; each metric's natural
range (`metric_range`: the one place that says a share lies in [0, 1] and a count, a
latency or a byte total in [0, inf)); and the rule that turns an interval into a verdict
(`compare`): a claim holds or fails only when the whole interval is on one side of its
bound; otherwise it is inconclusive and the interval is shown. numpy, and scipy for the t
quantile.

Must never: return an interval narrower than the data and the metric's range allow (one
value gives no interval: NaN bounds), drop NaN values silently (they are counted apart,
`num_nan`), bound a metric whose range it does not know (unknown names, differences
and other signed values are unbounded: a wrong bound would cut off real values), or clip
values that are outside the range they are said to have (ValueError: the range is wrong).

Estimands:
- `t_interval(values)`: the mean over seeds of a per-run metric, mean +- t_{0.975, n-1} *
  s / sqrt(n). Seeds are independent replicates of the workload, so this is the textbook
  interval; paired differences between arms (same seed = same requests) use it too.
  `t_interval(values, bounds=metric_range(name))` (or `.clip(lo, hi)`) intersects it with
  the metric's range, so a goodput, a p99 or a count never shows a negative bound. The
  estimand stays the arithmetic mean, and coverage is exactly the t-interval's: every
  value lies in [lo, hi], so the true mean does too, and for a mean in [lo, hi] "mean in
  the t-interval" and "mean in the t-interval intersected with [lo, hi]" are the same
  event (trial by trial, not only in probability; test_stats.py checks both). Clipping
  removes only values the mean cannot take; it does not make the interval honest where
  the t-interval is not: on skewed per-seed values (a p99, a rare count) with 2-5 seeds
  the t-interval itself covers less than 95% (measured in test_stats.py: exponential
  seeds 91% / 88.5% / 88% at n = 2 / 3 / 5, lognormal(sigma=1) 89% / 84% / 82%; 95% on
  normal seeds and about 94.5% on mildly skewed ones, lognormal(sigma=0.25)).
- `bootstrap_interval(groups, statistic)`: the mean over runs of a per-run statistic of
  request-level samples (a p99 TTFT), resampling requests within each run (stratified;
  Efron's percentile method). Used for a percentile metric of a point with ONE run, where
  there is no seed spread to take a t-interval of. With two or more seeds the t-interval of
  the per-seed percentiles is used instead: seeds are independent, whereas requests of
  one run queue behind each other and are not, so a request-level bootstrap would be too
  narrow on real runs; and resampling seeds on top of requests counts the sampling noise
  of the percentile twice (measured: 100% coverage of a nominal 95%, test_stats.py).
  Percentiles of in-range samples are in range, so it needs no clipping (clipping it is
  harmless).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import scipy.stats

LEVEL = 0.95
NUM_RESAMPLES = 2000
_LEVEL = contextvars.ContextVar("confidence_level", default=LEVEL)


def confidence_level() -> float:
    """The level an interval takes when none is passed: LEVEL, or `confidence`'s."""
    return _LEVEL.get()


@contextlib.contextmanager
def confidence(level: float) -> Iterator[None]:
    """Intervals computed inside take `level` by default: a verdict judged again at a
    stricter level (experiments.multiplicity's corrections) without threading a level
    through every judge."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    token = _LEVEL.set(level)
    try:
        yield
    finally:
        _LEVEL.reset(token)


Range = tuple[float, float]
UNIT: Range = (0.0, 1.0)
NONNEGATIVE: Range = (0.0, math.inf)
UNBOUNDED: Range = (-math.inf, math.inf)


class Interval(NamedTuple):
    """A point estimate with a two-sided interval at `level`; lo/hi are NaN when fewer than
    two finite values exist."""

    mean: float
    lo: float
    hi: float
    num: int  # finite values used
    num_nan: int = 0  # values left out because they were NaN (undefined for that run)
    level: float = LEVEL

    @property
    def is_defined(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def format(self, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
        """`4.15 [3.9, 4.4]` (n=5), or `4.15 (n=1, no interval)`."""

        def g(x: float) -> str:
            return f"{x * scale:.{digits}g}"

        if math.isnan(self.mean):
            return "–"
        if not self.is_defined:
            return f"{g(self.mean)}{unit} (n={self.num}, no interval)"
        return f"{g(self.mean)}{unit} [{g(self.lo)}, {g(self.hi)}]"

    def clip(self, lo: float = -math.inf, hi: float = math.inf) -> Interval:
        """The interval intersected with the metric's range [lo, hi] (`metric_range`);
        same coverage of a mean that lies in the range (module docstring). An undefined
        interval stays undefined. Raises ValueError when the mean is outside the range:
        then the range is wrong for these values, and clipping would hide it."""
        if lo > hi:
            raise ValueError(f"empty range [{lo}, {hi}]")
        if math.isnan(self.mean):
            return self
        if not lo <= self.mean <= hi:
            raise ValueError(f"mean {self.mean} outside the metric's range [{lo}, {hi}]")
        if not self.is_defined:
            return self
        return self._replace(lo=min(max(self.lo, lo), hi), hi=max(min(self.hi, hi), lo))


# ---------------------------------------------------------------- metric ranges

# Words of a metric's name (split at "_", after an `sla{L}_` prefix) that make it signed: a
# difference or a change between arms can be negative whatever its unit.
_SIGNED_WORDS = frozenset({"minus", "diff", "delta", "gain", "change", "vs", "relative", "log"})
# Last word of a share of something: [0, 1] (slo_attainment, stall_share, token_agreement,
# exact_match_share, early_save_precision, early_save_recall).
_UNIT_LAST = frozenset({"share", "attainment", "precision", "recall", "agreement"})
# Words of quantities that cannot be negative: seconds (`_s`, rates `req_s`), milliseconds,
# bytes, tokens, ratios of such quantities (`stored_over_raw`, `*_ratio`: may exceed 1).
_NONNEGATIVE_WORDS = frozenset({"s", "ms", "bytes", "gb", "mb", "tokens", "ratio", "over"})
# First words of counts: num_preemptions, peak_priority_preemptions_per_min.
_COUNT_FIRST = frozenset({"num", "peak"})
# Counts the early-save engine reports under its own names (`early_*` summary keys).
_NONNEGATIVE_NAMES = frozenset({"early_save_selected", "early_save_refused"})


def metric_range(name: str) -> Range:
    """The values metric `name` can take: `UNIT` (shares, attainment, precision, recall,
    agreement), `NONNEGATIVE` (counts, bytes, seconds, rates, goodput, latencies, ratios
    such as compression's stored/raw, which may exceed 1) or `UNBOUNDED` (differences,
    signed values, and any name not known here). Per-SLA-class names (`sla2_goodput_req_s`)
    take their base metric's range."""
    base = re.sub(r"^sla\d+_", "", name)
    words = base.split("_")
    if not base or _SIGNED_WORDS.intersection(words):
        return UNBOUNDED
    if words[-1] in _UNIT_LAST:
        return UNIT
    if base in _NONNEGATIVE_NAMES or words[0] in _COUNT_FIRST or _NONNEGATIVE_WORDS.intersection(words):
        return NONNEGATIVE
    return UNBOUNDED


# ---------------------------------------------------------------- Student t


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (scipy)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(scipy.stats.t.ppf(p, df))


# ---------------------------------------------------------------- intervals


def _finite(values: Sequence[float]) -> tuple[np.ndarray, int]:
    arr = np.asarray([float(v) for v in values], dtype=np.float64)
    mask = np.isfinite(arr)
    return arr[mask], int((~mask).sum())


def t_interval(values: Sequence[float], level: float | None = None, *, bounds: Range = UNBOUNDED) -> Interval:
    """Mean of `values` (one per seed) with its Student-t interval at `level` (default:
    `confidence_level()`), intersected with `bounds` (the metric's range,
    `metric_range(name)`; unbounded by default)."""
    level = confidence_level() if level is None else level
    arr, num_nan = _finite(values)
    n = len(arr)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, num_nan, level)
    mean = float(arr.mean())
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, num_nan, level).clip(*bounds)
    half = t_quantile(0.5 + level / 2.0, n - 1) * float(arr.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, num_nan, level).clip(*bounds)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float | None = None) -> Interval:
    """mean(a) - mean(b) for two independent samples (not paired), with Welch's interval
    (Welch-Satterthwaite degrees of freedom); `num` counts both samples' finite values.
    lo/hi are NaN when either sample has fewer than two finite values."""
    level = confidence_level() if level is None else level
    x, nan_x = _finite(a)
    y, nan_y = _finite(b)
    n, num_nan = len(x) + len(y), nan_x + nan_y
    if len(x) == 0 or len(y) == 0:
        return Interval(math.nan, math.nan, math.nan, n, num_nan, level)
    diff = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return Interval(diff, math.nan, math.nan, n, num_nan, level)
    vx, vy = float(x.var(ddof=1)) / len(x), float(y.var(ddof=1)) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return Interval(diff, diff, diff, n, num_nan, level)
    df = (vx + vy) ** 2 / (vx * vx / (len(x) - 1) + vy * vy / (len(y) - 1))
    half = t_quantile(0.5 + level / 2.0, df) * se
    return Interval(diff, diff - half, diff + half, n, num_nan, level)


def ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], level: float | None = None
) -> Interval:
    """The ratio of two paired means, mean(numerator) / mean(denominator), with Fieller's
    interval (Fieller 1954): the values of theta for which mean(x) - theta * mean(y) is
    within its own t-interval of 0, correlations between x and y included. Pairs with a
    NaN are left out. Bounded only when the denominator's mean is itself clear of 0 at
    `level`; otherwise lo/hi are NaN (the ratio's interval would be the whole line).
    `level` defaults to `confidence_level()`."""
    level = confidence_level() if level is None else level
    x = np.asarray([float(v) for v in numerator], dtype=np.float64)
    y = np.asarray([float(v) for v in denominator], dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError("numerator and denominator need one value per pair")
    mask = np.isfinite(x) & np.isfinite(y)
    x, y, n = x[mask], y[mask], int(mask.sum())
    num_nan = int((~mask).sum())
    if n == 0 or y.mean() == 0:
        return Interval(math.nan, math.nan, math.nan, n, num_nan, level)
    mx, my = float(x.mean()), float(y.mean())
    ratio = mx / my
    if n < 2:
        return Interval(ratio, math.nan, math.nan, n, num_nan, level)
    t2 = t_quantile(0.5 + level / 2.0, n - 1) ** 2
    cov = np.cov(np.stack([x, y]), ddof=1) / n  # covariance of the two means
    a = my * my - t2 * cov[1, 1]
    b = mx * my - t2 * cov[0, 1]
    c = mx * mx - t2 * cov[0, 0]
    disc = b * b - a * c
    if a <= 0 or disc < 0:  # the denominator is not clear of 0: no bounded interval
        return Interval(ratio, math.nan, math.nan, n, num_nan, level)
    root = math.sqrt(disc)
    return Interval(ratio, float((b - root) / a), float((b + root) / a), n, num_nan, level)


def bootstrap_interval(
    groups: Sequence[Sequence[float]],
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    level: float | None = None,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Mean over groups (seeds) of a per-group statistic, with a stratified bootstrap
    interval: each resample redraws every group's samples with replacement (groups kept).
    `statistic` maps (R, n) samples to (R,) values along the last axis
    (`percentile_statistic(99)`, `mean_statistic`). Groups with no finite sample count as
    NaN and are left out. Deterministic for a given `seed`. `level` defaults to
    `confidence_level()`."""
    level = confidence_level() if level is None else level
    arrays = []
    num_nan = 0
    for group in groups:
        arr, _ = _finite(group)
        if len(arr):
            arrays.append(arr)
        else:
            num_nan += 1
    n = len(arrays)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, num_nan, level)
    mean = float(np.mean([statistic(a[None, :])[0] for a in arrays]))
    if n < 2 and len(arrays[0]) < 2:
        return Interval(mean, math.nan, math.nan, n, num_nan, level)
    rng = np.random.default_rng(seed)
    # within-group resamples, one row per bootstrap replicate: (n, R)
    within = np.stack([statistic(a[rng.integers(0, len(a), size=(num_resamples, len(a)))]) for a in arrays])
    stats = within.mean(axis=0)  # (R,)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return Interval(mean, float(lo), float(hi), n, num_nan, level)


def percentile_statistic(q: float) -> Callable[[np.ndarray], np.ndarray]:
    """The q-th percentile along the last axis (numpy's linear interpolation, as the run
    metrics use)."""
    return lambda a: np.percentile(a, q, axis=-1)


def mean_statistic(a: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1)


# ---------------------------------------------------------------- verdicts


def compare(interval: Interval, bound: float, *, claimed: str) -> str | None:
    """'held' / 'did not hold' when the whole interval is on one side of `bound`, else None
    (inconclusive). `claimed` is the side the claim says the value lies on: 'above' or
    'below'. Touching the bound counts as not beyond it."""
    if claimed not in ("above", "below"):
        raise ValueError(f"claimed must be 'above' or 'below', got {claimed!r}")
    if not interval.is_defined:
        return None
    if claimed == "above":
        if interval.lo > bound:
            return "held"
        if interval.hi < bound:
            return "did not hold"
    else:
        if interval.hi < bound:
            return "held"
        if interval.lo > bound:
            return "did not hold"
    return None
