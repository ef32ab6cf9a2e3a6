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

Colours (`arm_styles`): a figure with more arms than the palette has colours draws the
design arms and the named baselines (experiments.dominance) each in its own colour, always
the same one, from a colour-blind-safe palette, and every other arm thin and grey with one
legend entry between them; a figure with few arms colours them all.

Must never: compute a metric the table does not have (the bar charts plot the results
or summary rows; only the CDFs and the time series read the runs' parquet files), show
one seed as if it were the point, or fail the ablation because a run has nothing to plot
(an empty panel says so instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from experiments.arms import STANDARD_ARMS
from experiments.dominance import DESIGN_ARMS, is_baseline
from preempt.kv.record import is_preemption


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


# Paul Tol's "muted" palette (colour-blind safe, nine hues: one per design arm and named
# baseline), the darkest first; the pale cyan and sand last.
PALETTE = ("#CC6677", "#332288", "#117733", "#882255", "#44AA99", "#AA4499", "#999933", "#88CCEE", "#DDCC77")
GREY = "#bbbbbb"
OTHER_ARMS = "other arms"


class ArmStyle(NamedTuple):
    """How a figure draws one arm. `is_highlighted`: in its own colour with its own legend
    entry; otherwise grey and thin, and `legend` is the entry the grey arms share ('other
    arms (N)', given to the first of them) or hidden (a leading '_', matplotlib's rule)."""

    color: str
    linestyle: str
    linewidth: float
    is_highlighted: bool
    legend: str

    def line(self, **overrides: Any) -> dict[str, Any]:
        """matplotlib line keywords; the coloured arms are drawn over the grey ones."""
        style = {"color": self.color, "linestyle": self.linestyle, "linewidth": self.linewidth}
        return {**style, "zorder": 3 if self.is_highlighted else 2, **overrides}

    def label(self, text: str) -> str:
        """The legend entry of the arm's main line: `text` for a highlighted arm."""
        return text if self.is_highlighted else self.legend


def arm_styles(arms: Sequence[str], design_arms: Sequence[str] = DESIGN_ARMS) -> dict[str, ArmStyle]:
    """Each arm's style. The design arms (solid, wide) and the named baselines (dashed) have
    a fixed colour each, from their place in DESIGN_ARMS + the registry's baselines (present
    or not), so an arm has the same colour in every figure. With more arms than PALETTE has
    colours, the other arms are grey; with fewer, they take the colours left over."""
    arms = list(dict.fromkeys(arms))
    baselines = [name for name in STANDARD_ARMS if is_baseline(name)]
    slots = list(dict.fromkeys([*DESIGN_ARMS, *baselines, *design_arms, *filter(is_baseline, arms)]))
    highlighted = [a for a in arms if a in design_arms or is_baseline(a)]
    colors = {a: PALETTE[slots.index(a) % len(PALETTE)] for a in highlighted}
    if len(arms) <= len(PALETTE):  # room for every arm
        free = iter([c for c in PALETTE if c not in colors.values()] + list(PALETTE))
        colors.update({a: next(free) for a in arms if a not in colors})
    grey = [a for a in arms if a not in colors]
    styles = {a: ArmStyle(GREY, "-", 0.8, False, f"_{a}") for a in grey}
    if grey:
        styles[grey[0]] = styles[grey[0]]._replace(legend=f"{OTHER_ARMS} ({len(grey)})")
    for arm, color in colors.items():
        second_round = arm in highlighted and slots.index(arm) >= len(PALETTE)  # colour reused
        linestyle = ":" if second_round else "--" if is_baseline(arm) else "-"
        styles[arm] = ArmStyle(color, linestyle, 2.2 if arm in design_arms else 1.5, True, arm)
    first = [a for a in slots if a in highlighted]  # the legend's order: the design, then baselines
    return {a: styles[a] for a in [*first, *(a for a in arms if a not in first)]}


def _suffix(point: dict[str, Any]) -> str:
    return "".join(f"-{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())


def _finite(values: Sequence[Any]) -> bool:
    return any(isinstance(v, int | float) and not math.isnan(v) for v in values)


# A grid point's runs, per arm: (label, [(seed or None, run directory), ...]), one entry
# per seed that ran ok; without seeds, one run per arm (seed None).
ArmRuns = list[tuple[str, list[tuple[Any, Path]]]]

FAINT = {"alpha": 0.3, "linewidth": 0.8}  # one seed's line, under its arm's pooled one


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
    styles = arm_styles(list(tables))
    for ax, level in zip(axes[0], levels, strict=False):
        for arm, seed_tables in tables.items():
            style = styles[arm]
            per_seed = [
                np.sort(
                    [v for lv, v in zip(t["sla_level"], t[column], strict=True) if lv == level and v == v]
                )
                for t in seed_tables
            ]
            if len(per_seed) > 1 and style.is_highlighted:  # a grey arm: its pooled line only
                for values in per_seed:
                    if len(values):
                        _cdf(ax, values, **style.line(**FAINT))
            pooled = np.sort(np.concatenate(per_seed)) if per_seed else np.array([])
            if len(pooled):
                _cdf(ax, pooled, label=style.label(arm), **style.line())
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
    styles = arm_styles([arm for arm, _ in arm_runs])
    for arm, runs in arm_runs:
        style = styles[arm]
        per_seed = [_preemption_times(run_dir) for _, run_dir in runs]
        if len(per_seed) == 1:
            times = per_seed[0]
            label = style.label(f"{arm} ({len(times)})")
            ax.step([0.0, *times], np.arange(len(times) + 1), where="post", label=label, **style.line())
            continue
        if style.is_highlighted:  # a grey arm: its mean only
            for times in per_seed:
                ax.step([0.0, *times], np.arange(len(times) + 1), where="post", **style.line(**FAINT))
        grid = np.array([0.0, *sorted({t for times in per_seed for t in times})])
        mean = np.mean([np.searchsorted(times, grid, side="right") for times in per_seed], axis=0)
        totals = [len(times) for times in per_seed]
        label = style.label(f"{arm} (mean {np.mean(totals):.3g}; {'/'.join(map(str, totals))})")
        ax.step(grid, mean, where="post", label=label, **style.line())
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
    """One panel per metric (two a row): mean against `axis`, one line per arm (arm_styles:
    the design and the named baselines in colour with their 95% band over seeds, the rest
    grey), and one legend under the panels. `categories`: a non-numeric axis (an SLA mix),
    placed evenly in this order."""
    plt = _pyplot()

    def position(value: Any) -> float:
        return float(categories.index(str(value))) if categories is not None else float(value)

    styles = arm_styles([p["arm"] for p in points])
    num_cols = min(2, len(metrics))
    num_rows = math.ceil(len(metrics) / num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(5 * num_cols, 3.6 * num_rows), squeeze=False)
    for ax in axes.flat[len(metrics) :]:
        ax.set_visible(False)
    for ax, (metric, label) in zip(axes.flat, metrics, strict=False):
        drawn = False
        for arm, style in styles.items():
            rows = sorted(
                (p for p in points if p["arm"] == arm and _finite([p.get(metric)])),
                key=lambda p: position(p[axis]),
            )
            if not rows:
                continue
            drawn = True
            x = np.array([position(r[axis]) for r in rows])
            y = np.array([float(r[metric]) for r in rows])
            if not style.is_highlighted:  # grey: the line alone (bands of ten arms hide the rest)
                ax.plot(x, y, label=style.legend, **style.line())
                continue
            lo = np.array([float(r.get(f"{metric}_lo", math.nan)) for r in rows])
            hi = np.array([float(r.get(f"{metric}_hi", math.nan)) for r in rows])
            ax.plot(x, y, marker="o", markersize=3, label=arm, **style.line())
            ax.fill_between(x, lo, hi, color=style.color, alpha=0.15, linewidth=0, zorder=1)
        if not drawn:  # no run of any arm finished here (e.g. a dead Ray worker): say so
            ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes)
        elif categories is not None:
            ax.set_xticks(range(len(categories)), categories, fontsize=8)
        else:
            xs = [float(p[axis]) for p in points if axis in p]
            if xs and min(xs) > 0 and max(xs) / min(xs) >= 8:  # load from 0.25x to 4x: even steps
                ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    entries: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    _legend_below(fig, entries)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _legend_below(fig, entries: dict[str, Any], num_cols: int = 4) -> None:
    """One legend for all panels, under them (label -> handle): the coloured arms in the
    order given, then the grey arms' shared entries by name."""

    def place(label: str) -> tuple[int, str]:
        return (1, label) if label.startswith(OTHER_ARMS) else (0, "")

    labels = sorted(entries, key=place)
    if labels:
        fig.legend(
            [entries[label] for label in labels], labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
            ncol=min(num_cols, len(labels)), fontsize=10, frameon=False,
        )  # fmt: skip


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
