"""Seeds -> points: one row per arm and grid point with every metric's 95% interval.

Owns: `aggregate` (the rows of `summary.csv`: description and grid columns, the seeds
that ran, and for every metric `m` its mean `m` and interval `m_lo`, `m_hi`), and which
interval each metric gets (preempt.obs.stats): a Student-t interval over seeds; a
percentile metric of a point with one run only gets a bootstrap over that run's requests
instead (there is no seed spread then; its caveat is in preempt/obs/stats.py). Either is
intersected with the metric's range (`stats.metric_range`: a share in [0, 1], a count,
latency or byte total in [0, inf)), so tables and sweep bands never show a bound the
mean cannot take; coverage stays the interval's own (preempt/obs/stats.py).

Must never: mix seeds of different points or arms, fill an interval where fewer than
two values exist (NaN bounds: tables say "no interval"), or clip a metric whose range
preempt.obs.stats does not know (unknown names stay unbounded).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from experiments.catalogue import DESCRIPTION_COLUMNS, NAN, NOT_REPRODUCIBLE
from experiments.plan import AblationPlan, run_key, without_seed
from preempt.obs.stats import Interval, bootstrap_interval, metric_range, percentile_statistic, t_interval

# (sla level or None, latency column, percentile) of a percentile metric's name
_PERCENTILE = re.compile(r"^(?:sla(\d+)_)?(ttft|tpot)_p(50|99)_s$")
SKIP = {*DESCRIPTION_COLUMNS, "notes", "quality_note", "seed", "num_seeds", "seeds"}


def point_key(arm: str, point: dict[str, Any]) -> str:
    return run_key(arm, without_seed(point))


def _request_interval(metric: str, run_dirs: list[Path]) -> Interval | None:
    """Bootstrap interval of a percentile metric over one run's requests."""
    match = _PERCENTILE.match(metric)
    if match is None:
        return None
    level, column, q = match.group(1), f"{match.group(2)}_s", float(match.group(3))
    groups = []
    for run_dir in run_dirs:
        path = run_dir / "requests.parquet"
        if not path.is_file():
            return None
        table = pq.read_table(path, columns=["sla_level", column]).to_pydict()
        groups.append(
            [
                v
                for lv, v in zip(table["sla_level"], table[column], strict=True)
                if v is not None and (level is None or lv == int(level))
            ]
        )
    return bootstrap_interval(groups, percentile_statistic(q), num_resamples=1000)


def interval_of(metric: str, values: list[float], run_dirs: list[Path]) -> Interval:
    """The 95% interval of `metric` over its seeds' `values`, within the metric's range."""
    bounds = metric_range(metric)
    finite = [v for v in values if isinstance(v, int | float) and not math.isnan(v)]
    if len(finite) == 1:
        boot = _request_interval(metric, run_dirs)
        if boot is not None and boot.is_defined:
            return Interval(finite[0], boot.lo, boot.hi, 1, len(values) - 1).clip(*bounds)
    return t_interval([float(v) for v in values], bounds=bounds)


def aggregate(plan: AblationPlan, rows: list[dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    """One row per (arm, grid point), in plan order, over the seeds that ran ok."""
    by_run = {row["run"]: row for row in rows}
    groups: dict[str, list[Any]] = {}
    for run in plan.runs:
        groups.setdefault(point_key(run.arm, run.grid_point), []).append(run)
    metric_columns: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key not in SKIP and key not in metric_columns and isinstance(value, int | float):
                metric_columns.append(key)
    grid_columns = [key.rsplit(".", 1)[-1] for key in plan.config.grid]
    out = []
    for key, runs in groups.items():
        first = by_run[runs[0].key]
        ok = [by_run[r.key] for r in runs if by_run[r.key]["status"] == "ok"]
        dirs = [out_dir / "arms" / r.key for r in runs if by_run[r.key]["status"] == "ok"]
        parent = runs[0].parent
        row: dict[str, Any] = {
            "run": key,
            "arm": first["arm"],
            "parent": point_key(plan.run(parent).arm, runs[0].grid_point) if parent else "",
            "status": "ok" if len(ok) == len(runs) else f"{len(ok)}/{len(runs)} ok",
            **{c: first[c] for c in DESCRIPTION_COLUMNS if c not in ("run", "arm", "parent", "status")},
            **{c: first[c] for c in grid_columns if c in first},
            "num_seeds": len(ok),
            "seeds": " ".join(str(r.grid_point.get("seed", r.config.seed)) for r in runs),
        }
        for metric in metric_columns:
            if metric in NOT_REPRODUCIBLE or metric in grid_columns:
                continue
            iv = interval_of(metric, [r.get(metric, NAN) for r in ok], dirs)
            row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"] = iv.mean, iv.lo, iv.hi
        out.append(row)
    return out


def interval(row: dict[str, Any], metric: str) -> Interval:
    """A summary row's interval of `metric` back as an Interval."""
    n = int(row.get("num_seeds", 1))
    lo, hi = float(row.get(f"{metric}_lo", NAN)), float(row.get(f"{metric}_hi", NAN))
    return Interval(float(row.get(metric, NAN)), lo, hi, n)
