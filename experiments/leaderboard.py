"""The leaderboard: every policy at every sweep point with intervals, its Pareto front, and
the "what to run where" table that summarises them.

Owns: rendering what experiments.dominance decides -- per point a table of every arm's
goodput, SLO attainment per class, TTFT/TPOT p50/p99 per class, preemptions and KV moved
(means with 95% intervals over seeds, from summary.csv), which arms dominate it (paired
intervals on experiments.dominance.OBJECTIVES), and a Pareto plot (goodput against the
top class's TTFT p99; SLO attainment against KV moved) with the design and the named
baselines in colour, the other arms grey, dominated arms hollow; and the one-screen table
of, per regime, the best policy by interval and the design's distance to it. Everything
comes from results.csv / summary.csv.

Must never: rank by means where the intervals tie (ties are listed as ties), or call an arm
dominated without a paired interval (experiments.dominance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from experiments.dominance import (
    BETTER,
    DESIGN_ARMS,
    OBJECTIVES,
    WORSE,
    Arms,
    Objective,
    comparable,
    compare_arms,
    dominators,
    is_oracle,
    top_level,
)
from experiments.tables import interval_cell, length_regime, sla_levels


def _names(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _ok_arms(arms: Arms) -> list[str]:
    """The arms that ran ok in some seed, among those comparable at the point."""
    return [name for name, rows in comparable(arms).items() if any(r["status"] == "ok" for r in rows)]


def best_by_interval(arms: Arms, objective: Objective) -> list[str]:
    """The arm with the best mean on `objective`, then every arm the paired interval cannot
    tell from it (not worse than it), best mean first. Empty when no arm has a value."""
    means = {}
    for name in _ok_arms(arms):
        rows = [r for r in arms[name] if r["status"] == "ok"]
        values = [float(r.get(objective.column(rows), math.nan)) for r in rows]
        values = [v for v in values if not math.isnan(v)]
        if values:
            means[name] = sum(values) / len(values)
    if not means:
        return []
    sign = 1.0 if objective.higher_is_better else -1.0
    order = sorted(means, key=lambda n: -sign * means[n])
    best = order[0]
    tied = []
    for name in order[1:]:
        comparison = compare_arms(arms, name, best, (objective,))
        if comparison is None or comparison.sides[0] != WORSE:
            tied.append(name)
    return [best, *tied]


def distance(arms: Arms, arm: str, to: str, objective: Objective) -> str:
    """`arm` - `to` on `objective`, paired by seed: `+0.12 (tied)`, `-0.35 (worse)` (the
    interval excludes 0 on the objective's bad side), or `best` for the best arm itself."""
    if arm == to:
        return "best"
    comparison = compare_arms(arms, arm, to, (objective,))
    if comparison is None:
        return "–"
    diff, where = comparison.diffs[0], comparison.sides[0]
    return f"{diff.mean:+.3g} ({'worse' if where == WORSE else 'better' if where == BETTER else 'tied'})"


class Ranking(NamedTuple):
    """One point's arms as the leaderboard shows them: their summary rows, the arms best
    goodput first, and who dominates each (computed once, for the tables and the plot)."""

    summary: dict[str, dict[str, Any]]
    names: list[str]
    beaten: dict[str, list[str]]


def rank(arms: Arms, points: list[dict[str, Any]] | None) -> Ranking:
    """The point's Ranking from its results rows (`arms`) and summary rows (`points`)."""
    summary = {row["arm"]: row for row in points or [] if row["arm"] in arms}
    names = [n for n in _ok_arms(arms) if n in summary]
    names.sort(key=lambda n: -float(summary[n].get("goodput_req_s", math.nan) or 0.0))
    return Ranking(summary, names, dominators(arms, names))


def point_tables(ranking: Ranking) -> str:
    """The leaderboard of one point: an overall table and a per-class table, arms by goodput."""
    summary, names, beaten = ranking
    if not names:
        return "(no summary.csv: run the sweep with seeds)"
    top = top_level([summary[n] for n in names])
    levels = sla_levels([summary[n] for n in names])
    head = ["arm", "goodput req/s", "SLO att."] + [f"L{lv} att." for lv in levels]
    head += [f"L{top} TTFT p99 s", "preempt.", "KV moved", "dominated by"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 2) + " --- |"]
    for name in names:
        row = summary[name]
        cells = [f"`{name}`", interval_cell(row, "goodput_req_s"), interval_cell(row, "slo_attainment")]
        cells += [interval_cell(row, f"sla{lv}_slo_attainment") for lv in levels]
        cells += [
            interval_cell(row, f"sla{top}_ttft_p99_s"),
            interval_cell(row, "num_preemptions"),
            interval_cell(row, "kv_bytes_moved"),
            _names(beaten[name]) if beaten[name] else "**front**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per SLA class (higher = more important), latencies in s:", ""]
    head = ["arm"]
    metrics = []
    for lv in levels:
        for metric, title in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
                              ("tpot_p50_s", "TPOT p50"), ("tpot_p99_s", "TPOT p99")):  # fmt: skip
            metrics.append(f"sla{lv}_{metric}")
            head.append(f"L{lv} {title}")
    lines += ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in names:
        lines.append(
            "| " + " | ".join([f"`{name}`"] + [interval_cell(summary[name], m) for m in metrics]) + " |"
        )
    return "\n".join(lines)


def pareto_plot(
    ranking: Ranking, path: Path, title: str, design_arms: Sequence[str] = DESIGN_ARMS
) -> Path | None:
    """Two panels, one above the other: goodput against the top class's TTFT p99, and SLO
    attainment against KV moved. The design arms and the named baselines in their colours
    (experiments.plots.arm_styles), the other arms grey; filled with 95% error bars over
    seeds on the front, hollow without bars where dominated (experiments.dominance); one
    legend under the panels names the coloured arms (and who dominates them). None without
    summary rows."""
    summary, names, beaten = ranking
    if not names:
        return None
    from experiments.plots import OTHER_ARMS, _legend_below, _pyplot, _save, arm_styles

    plt = _pyplot()
    top = top_level([summary[n] for n in names])
    panels = (
        (f"sla{top}_ttft_p99_s", "goodput_req_s", f"level-{top} TTFT p99 s (log)", "goodput req/s", "log"),
        ("kv_bytes_moved", "slo_attainment", "KV moved, bytes (symlog)", "SLO attainment", "symlog"),
    )
    fig, axes = plt.subplots(2, 1, figsize=(8, 9))
    styles = arm_styles(names, design_arms)
    entries: dict[str, Any] = {}  # the legend: label -> handle, the coloured arms in arm_styles' order
    for ax, (x_key, y_key, x_label, y_label, scale) in zip(axes, panels, strict=True):
        for name, style in styles.items():
            row = summary[name]
            x, y = float(row.get(x_key, math.nan)), float(row.get(y_key, math.nan))
            if math.isnan(x) or math.isnan(y):
                continue
            if not style.is_highlighted:
                label = f"{OTHER_ARMS}, {'dominated' if beaten[name] else 'front'}"
                handle, = ax.plot([x], [y], "o", color=style.color, markersize=5, zorder=2,
                                  markerfacecolor="none" if beaten[name] else style.color)  # fmt: skip
            elif beaten[name]:  # hollow, no bars: they would hide the front
                more = f" +{len(beaten[name]) - 1}" if len(beaten[name]) > 1 else ""
                label = f"{name} (dominated by {beaten[name][0]}{more})"
                handle, = ax.plot([x], [y], "o", color=style.color, markerfacecolor="none", markersize=8,
                                  markeredgewidth=1.6, zorder=3)  # fmt: skip
            else:
                label = name
                handle = ax.errorbar(
                    [x], [y], xerr=_half_widths(row, x_key), yerr=_half_widths(row, y_key), fmt="o",
                    color=style.color, markersize=8, elinewidth=1.0, capsize=3, zorder=4,
                )  # fmt: skip
            entries.setdefault(label, handle)
        if scale == "log":
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=1e8)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    _legend_below(fig, entries, num_cols=2)
    fig.suptitle(f"{title}\nmeans and 95% intervals over seeds; hollow = dominated (paired intervals)",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    return _save(fig, path)


def _half_widths(row: dict[str, Any], key: str) -> list[list[float]]:
    """matplotlib's asymmetric error bar of a summary row's metric: [[below], [above]]."""
    mean = float(row.get(key, math.nan))
    lo, hi = float(row.get(f"{key}_lo", mean)), float(row.get(f"{key}_hi", mean))
    return [
        [0.0 if math.isnan(lo) else max(mean - lo, 0.0)],
        [0.0 if math.isnan(hi) else max(hi - mean, 0.0)],
    ]


def where_to_run(
    regimes: list[tuple[str, Arms]], design_arms: Sequence[str] = DESIGN_ARMS, objectives=OBJECTIVES
) -> str:
    """One row per regime, among its deployable arms (no oracle): the front, the best arm per
    objective (with the arms the paired intervals cannot tell from it), and each design
    arm's distance to that best."""
    present = [d for d in design_arms if any(d in arms for _, arms in regimes)]
    head = ["regime", "front (not dominated; no oracle)"] + [f"best {o.label}" for o in objectives]
    head += [f"`{d}` - best, per objective" for d in present]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, every_arm in regimes:
        arms = {name: rows for name, rows in every_arm.items() if not is_oracle(name)}
        names = _ok_arms(arms)
        if not names:
            continue
        beaten = dominators(arms, names)
        front = [n for n in names if not beaten[n]]
        cells = [label, _names(front)]
        bests = [best_by_interval(arms, o) for o in objectives]
        for best in bests:
            tied = f" (tied: {_names(best[1:])})" if len(best) > 1 else ""
            cells.append(f"`{best[0]}`{tied}" if best else "–")
        for d in present:
            parts = [
                distance(arms, d, best[0], objective) if d in arms and best else "–"
                for objective, best in zip(objectives, bests, strict=True)
            ]
            cells.append("; ".join(parts))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def leaderboard_markdown(
    sections: list[tuple[str, Arms, list[dict[str, Any]] | None]],
    images_dir: Path,
    link_base: Path,
    design_arms: Sequence[str] = DESIGN_ARMS,
) -> str:
    """Per point (section label, arms, summary rows): the Pareto plot and the tables."""
    lines = []
    for label, arms, points in sections:
        regime = length_regime([row for rows in arms.values() for row in rows])
        lines += [f"## {label}", "", f"Lengths: {regime}.", ""]
        slug = "".join(c if c.isalnum() or c in "-_=." else "-" for c in label).strip("-")
        ranking = rank(arms, points)
        title = f"{label}; lengths: {regime.replace('**', '')}"
        plot = pareto_plot(ranking, images_dir / f"pareto-{slug}.png", title, design_arms)
        if plot is not None:
            lines += [f"![pareto {label}]({plot.relative_to(link_base)})", ""]
        lines += [point_tables(ranking), ""]
    return "\n".join(lines)
