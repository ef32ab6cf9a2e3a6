"""Plots of an ablation (PNG, matplotlib's Agg backend, no display needed).

Owns: the figures `preempt ablate` writes to `DIR/plots/` and logs to wandb: latency CDFs
per SLA class (TTFT, TPOT), preemptions over time, goodput, stall per preemption, bytes
saved per mode, and early-save precision/recall when the engine reports them. With a
grid, one set per grid point (file names end with the point). With seeds, every one of
them shows all seeds: the bars are summary.csv's means over seeds with their 95% error
bars (the title says over how many seeds), the CDFs pool each arm's requests over its
seeds (bold) over each seed's own CDF (faint), and the preemption counts are the mean
over seeds (bold) over each seed's (faint).

With seeds (a sweep), also the plots users expect of one: goodput, p99 TTFT and p99 TPOT
per SLA class against each grid axis (the load, `workload.rate_scale`, first; a non-numeric
one such as an SLA mix in the grid's order), one
line per arm with its 95% band over seeds (`plot_sweep`, from summary.csv's rows).

Must never: compute a metric the table does not have (the bar charts plot the results
or summary rows; only the CDFs and the time series read the runs' parquet files), show
one seed as if it were the point, or fail the ablation because a run has nothing to plot
(an empty panel says so instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from preempt.kv.record import is_preemption


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _styles(num: int) -> list[dict[str, Any]]:
    """Distinct line styles for up to 40 runs: ten colours, then a new dash pattern."""
    cmap = _pyplot().get_cmap("tab10")
    dashes = ("-", "--", ":", "-.")
    return [{"color": cmap(i % 10), "linestyle": dashes[(i // 10) % len(dashes)]} for i in range(num)]


def _suffix(point: dict[str, Any]) -> str:
    return "".join(f"-{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())


def _finite(values: Sequence[Any]) -> bool:
    return any(isinstance(v, int | float) and not math.isnan(v) for v in values)


# A grid point's runs, per arm: (label, [(seed or None, run directory), ...]), one entry
# per seed that ran ok; without seeds, one run per arm (seed None).
ArmRuns = list[tuple[str, list[tuple[Any, Path]]]]

FAINT = {"alpha": 0.3, "linewidth": 0.8}  # one seed's line, under its arm's pooled one
BOLD = {"linewidth": 1.8}  # an arm's line pooled or averaged over its seeds


def _seeds_note(arm_runs: ArmRuns, bold: str) -> str:
    """A second title line ('bold: <bold> over seeds 0 1 2; faint: each seed'), or '' with
    one run per arm."""
    seeds = list(dict.fromkeys(seed for _, runs in arm_runs for seed, _ in runs if seed is not None))
    if not seeds:
        return ""
    return f"\nbold: {bold} over seeds {' '.join(map(str, seeds))}; faint: each seed"


def _cdf(ax, values: np.ndarray, **style: Any) -> None:
    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", **style)


def latency_cdfs(arm_runs: ArmRuns, column: str, path: Path) -> Path:
    """One panel per SLA class, one empirical CDF per arm of `column` (ttft_s, tpot_s):
    the requests of all its seeds pooled (bold), and each seed's own CDF (faint)."""
    plt = _pyplot()
    tables = {
        arm: [
            pq.read_table(run_dir / "requests.parquet", columns=["sla_level", column]).to_pydict()
            for _, run_dir in runs
        ]
        for arm, runs in arm_runs
    }
    levels = sorted({level for ts in tables.values() for t in ts for level in t["sla_level"]})
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(5 * max(1, len(levels)), 4), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=False):
        for (arm, seed_tables), style in zip(tables.items(), _styles(len(tables)), strict=True):
            per_seed = [
                np.sort(
                    [v for lv, v in zip(t["sla_level"], t[column], strict=True) if lv == level and v == v]
                )
                for t in seed_tables
            ]
            if len(per_seed) > 1:
                for values in per_seed:
                    if len(values):
                        _cdf(ax, values, **style, **FAINT)
            pooled = np.sort(np.concatenate(per_seed)) if per_seed else np.array([])
            if len(pooled):
                _cdf(ax, pooled, label=arm, **(BOLD if len(per_seed) > 1 else {}), **style)
        ax.set_xscale("log")
        ax.set_title(f"SLA level {level}")
        ax.set_xlabel(f"{column} (virtual s, log)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    note = _seeds_note(arm_runs, "requests pooled")
    # a second title line would overlap the panels' titles at the default height
    fig.suptitle(f"{column.removesuffix('_s').upper()} CDF per SLA class{note}", y=1.06 if note else 0.98)
    return _save(fig, path)


def _preemption_times(run_dir: Path) -> list[float]:
    rec = pq.read_table(run_dir / "preemptions.parquet", columns=["time_s", "reason", "action"]).to_pydict()
    return sorted(
        t
        for t, reason, action in zip(rec["time_s"], rec["reason"], rec["action"], strict=True)
        if is_preemption(reason, action)
    )


def preemptions_over_time(arm_runs: ArmRuns, path: Path) -> Path:
    """Cumulative preemptions (priority + memory) against simulated time, one line per arm:
    with seeds, the mean over its seeds of the count so far (bold) and each seed's (faint)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (arm, runs), style in zip(arm_runs, _styles(len(arm_runs)), strict=True):
        per_seed = [_preemption_times(run_dir) for _, run_dir in runs]
        if len(per_seed) == 1:
            times = per_seed[0]
            ax.step(
                [0.0, *times], np.arange(len(times) + 1), where="post", label=f"{arm} ({len(times)})", **style
            )
            continue
        for times in per_seed:
            ax.step([0.0, *times], np.arange(len(times) + 1), where="post", **style, **FAINT)
        grid = np.array([0.0, *sorted({t for times in per_seed for t in times})])
        mean = np.mean([np.searchsorted(times, grid, side="right") for times in per_seed], axis=0)
        totals = [len(times) for times in per_seed]
        label = f"{arm} (mean {np.mean(totals):.3g}; {'/'.join(map(str, totals))})"
        ax.step(grid, mean, where="post", label=label, **BOLD, **style)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("preemptions so far")
    ax.set_title("Preemptions over time" + _seeds_note(arm_runs, "mean count"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return _save(fig, path)


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _over_seeds(rows: list[dict[str, Any]]) -> str:
    """'mean and 95% interval over 3 seeds' of summary rows ('2-3 seeds' where points lost
    runs), or '' for results rows (one run per arm)."""
    counts = sorted({int(r["num_seeds"]) for r in rows if "num_seeds" in r})
    if not counts:
        return ""
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"mean and 95% interval over {seeds} seed{'s' if counts[-1] != 1 else ''}"


def bars(
    rows: list[dict[str, Any]],
    columns: list[tuple[str, str]],
    path: Path,
    title: str,
    ylabel: str,
    empty_note: str,
) -> Path:
    """Grouped bars of results columns per run; runs where all are NaN are left out. With
    summary rows (seeds), the bar is the mean over seeds and its error bar the row's 95%
    interval (`m_lo`, `m_hi`; none where it is undefined, e.g. one seed ran ok)."""
    plt = _pyplot()
    rows = [r for r in rows if _finite([r.get(c) for c, _ in columns])]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    if not rows:
        ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        width = 0.8 / len(columns)
        x = np.arange(len(rows))
        for i, (column, label) in enumerate(columns):
            xs = x + (i - (len(columns) - 1) / 2) * width
            values = np.array([_float(r.get(column)) for r in rows])
            lo = np.array([_float(r.get(f"{column}_lo")) for r in rows])
            hi = np.array([_float(r.get(f"{column}_hi")) for r in rows])
            ax.bar(xs, values, width, label=label)
            has = np.isfinite(values) & np.isfinite(lo) & np.isfinite(hi)
            if has.any():
                err = np.stack([values[has] - lo[has], hi[has] - values[has]])
                ax.errorbar(
                    xs[has], values[has], yerr=err, fmt="none", ecolor="black", elinewidth=1, capsize=3
                )
        ax.set_xticks(x, [r["run"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        if len(columns) > 1:
            ax.legend(fontsize=8)
    note = _over_seeds(rows)
    ax.set_title(f"{title}\n({note})" if note else title)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_ablation(
    points: list[dict[str, Any]],
    out_dir: Path,
    runs: list[tuple[str, dict[str, Any], Any, str]],
) -> list[Path]:
    """Every plot of the ablation under `out_dir/plots`; returns the files written.

    `points`: one row per arm and grid point: summary.csv's rows with seeds (each metric
    `m` the mean over seeds, `m_lo`/`m_hi` its 95% interval; bars are drawn with error
    bars), the results rows without (one run per arm). `runs`: (point, grid point without
    its seed, seed or None, run key) of every run that finished ok; the CDFs and the
    preemption counts read their files, every seed of an arm."""
    plots_dir = out_dir / "plots"
    by_point = {row["run"]: row for row in points}
    grid: dict[str, dict[str, list[tuple[Any, Path]]]] = {}  # suffix -> point -> runs
    for point, grid_point, seed, key in runs:
        grid.setdefault(_suffix(grid_point), {}).setdefault(point, []).append((seed, out_dir / "arms" / key))
    written: list[Path] = []
    for suffix, of_point in grid.items():
        point_rows = [by_point[p] for p in of_point]
        arm_runs = list(of_point.items())
        written += [
            latency_cdfs(arm_runs, "ttft_s", plots_dir / f"ttft_cdf{suffix}.png"),
            latency_cdfs(arm_runs, "tpot_s", plots_dir / f"tpot_cdf{suffix}.png"),
            preemptions_over_time(arm_runs, plots_dir / f"preemptions_over_time{suffix}.png"),
            bars(
                point_rows,
                [("goodput_req_s", "goodput")],
                plots_dir / f"goodput{suffix}.png",
                "Goodput (requests within SLO per second)",
                "req/s",
                "no run finished",
            ),
            bars(
                point_rows,
                [("stall_per_preemption_ms", "stall per preemption")],
                plots_dir / f"stall_per_preemption{suffix}.png",
                "Compute stall per preemption (KV moves on the critical path)",
                "ms",
                "no preemptions",
            ),
            bars(
                [r for r in point_rows if r.get("kv_saved_bytes_raw", 0)],
                [("kv_saved_bytes_raw", "raw"), ("kv_saved_bytes_stored", "stored")],
                plots_dir / f"bytes_saved{suffix}.png",
                "KV bytes saved per arm (mode): raw vs stored in the host pool",
                "bytes",
                "no arm saved KV",
            ),
        ]
        if any(_finite([r.get("early_save_precision"), r.get("early_save_recall")]) for r in point_rows):
            written.append(
                bars(
                    point_rows,
                    [("early_save_precision", "precision"), ("early_save_recall", "recall")],
                    plots_dir / f"early_save_precision_recall{suffix}.png",
                    "Early saves: precision and recall of the trigger",
                    "share",
                    "no early-save statistics",
                )
            )
    return written


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def sweep_lines(
    points: list[dict[str, Any]],
    axis: str,
    metrics: list[tuple[str, str]],
    path: Path,
    title: str,
    categories: list[str] | None = None,
) -> Path:
    """One panel per metric: mean against `axis`, one line per arm, 95% band over seeds.
    `categories`: a non-numeric axis (an SLA mix), placed evenly in this order."""
    plt = _pyplot()

    def position(value: Any) -> float:
        return float(categories.index(str(value))) if categories is not None else float(value)

    arms = list(dict.fromkeys(p["arm"] for p in points))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics, strict=True):
        drawn = False
        for arm, style in zip(arms, _styles(len(arms)), strict=True):
            rows = sorted(
                (p for p in points if p["arm"] == arm and _finite([p.get(metric)])),
                key=lambda p: position(p[axis]),
            )
            if not rows:
                continue
            drawn = True
            x = np.array([position(r[axis]) for r in rows])
            y = np.array([float(r[metric]) for r in rows])
            lo = np.array([float(r.get(f"{metric}_lo", math.nan)) for r in rows])
            hi = np.array([float(r.get(f"{metric}_hi", math.nan)) for r in rows])
            ax.plot(x, y, marker="o", markersize=3, label=arm, **style)
            ax.fill_between(x, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
        if not drawn:  # no run of any arm finished here (e.g. a dead Ray worker): say so
            ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes)
        elif categories is not None:
            ax.set_xticks(range(len(categories)), categories, fontsize=8)
        else:
            xs = [float(p[axis]) for p in points if axis in p]
            if xs and min(xs) > 0 and max(xs) / min(xs) >= 8:  # load from 0.25x to 4x: even steps
                ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title)
    return _save(fig, path)


def plot_sweep(points: list[dict[str, Any]], grid: dict[str, list[Any]], plots_dir: Path) -> list[Path]:
    """Per grid axis (others held at each of their values): goodput and p99 TTFT / TPOT
    per SLA class against the axis, one line per arm, 95% bands. A non-numeric axis (an
    SLA mix) is placed in the grid's order."""
    written: list[Path] = []
    columns = {key: key.rsplit(".", 1)[-1] for key in grid}
    axes = [key for key, values in grid.items() if len(values) > 1]
    axes.sort(key=lambda key: key != "workload.rate_scale")  # load first
    names = {k for p in points for k in p}
    levels = sorted(
        {k[3:].split("_", 1)[0] for k in names if k.startswith("sla") and k[3:4].isdigit()},
        key=int,
    )
    for axis in axes:
        x = columns[axis]
        categories = None if _numeric(grid[axis]) else [str(v) for v in grid[axis]]
        others = [columns[k] for k in grid if k != axis]
        slices: dict[tuple, list[dict[str, Any]]] = {}
        for p in points:
            slices.setdefault(tuple(p.get(c) for c in others), []).append(p)
        for fixed, rows in slices.items():
            suffix = "".join(f"-{c}={v}" for c, v in zip(others, fixed, strict=True))
            for kind, label in (("goodput_req_s", "goodput req/s"), ("ttft_p99_s", "TTFT p99 s"),
                                ("tpot_p99_s", "TPOT p99 s")):  # fmt: skip
                metrics = [(kind, f"all classes: {label}")] + [
                    (f"sla{lv}_{kind}", f"SLA level {lv}: {label}") for lv in levels
                ]
                written.append(
                    sweep_lines(
                        rows,
                        x,
                        metrics,
                        plots_dir / f"sweep_{kind}_vs_{x}{suffix}.png",
                        f"{label} vs {x} (mean and 95% interval over seeds){suffix.replace('-', ' ')}",
                        categories,
                    )  # fmt: skip
                )
    return written
