"""Tables of an ablation: `results.csv` (one row per run), `results.md`, and the cells.

Owns: reading and writing `results.csv` (NaN as `nan`), cell formatting, the markdown
tables (main, per SLA class, with 95% intervals over seeds), the "same metrics as its
parent" note, and `results.md`.

Must never: compute a metric (rows come from `experiments.measure` and
`experiments.aggregate`) or run anything.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from experiments.catalogue import METRICS, NAN, NOT_REPRODUCIBLE


def metric_fingerprint(row: dict[str, Any]) -> tuple:
    return tuple(
        (k, None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in row.items()
        if k in METRICS and k not in NOT_REPRODUCIBLE
    )


def note_no_effect(rows: list[dict[str, Any]]) -> None:
    by_run = {row["run"]: row for row in rows}
    for row in rows:
        parent = by_run.get(row["parent"]) if row["parent"] else None
        if parent is None or row["status"] != "ok" or parent["status"] != "ok":
            continue
        if metric_fingerprint(row) == metric_fingerprint(parent):
            row["notes"].append(
                f"same metrics as its parent '{parent['run']}': the change had no effect on this "
                "workload, or the engine does not act on it yet"
            )


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return value


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """results.csv back into rows, numbers as numbers (NaN as float nan)."""

    def parse(value: str) -> Any:
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return value

    with path.open(newline="") as handle:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def fmt(value: Any, column: str = "") -> str:
    """A table cell: bytes humanized, floats to 3 significant digits, NaN as '–'."""
    if isinstance(value, float) and math.isnan(value):
        return "–"
    if isinstance(value, int | float) and "bytes" in column:
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= size:
                return f"{value / size:.3g} {unit}"
        return f"{int(value)} B"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


MD_COLUMNS = (
    ("run", "run"),
    ("goodput_req_s", "goodput req/s"),
    ("slo_attainment", "SLO att."),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tpot_p99_s", "TPOT p99 s"),
    ("num_preemptions", "preempt."),
    ("num_preemption_failed", "failed"),
    ("recomputed_tokens", "recomp. tok"),
    ("preemption_stall_s", "stall s"),
    ("stall_per_preemption_ms", "stall/preempt ms"),
    ("kv_bytes_moved", "moved"),
    ("kv_saved_bytes_stored", "stored"),
    ("stored_over_raw", "stored/raw"),
    ("host_pool_peak_bytes", "host peak"),
    ("save_ms_p50", "save ms p50"),
    ("restore_ms_p50", "restore ms p50"),
    ("token_agreement", "token agr."),
    ("exact_match_share", "exact"),
)


def markdown_table(rows: list[dict[str, Any]], columns: Iterable[tuple[str, str]]) -> str:
    columns = [(key, title) for key, title in columns if any(key in row for row in rows)]
    lines = [
        "| " + " | ".join(title for _, title in columns) + " |",
        "|" + "|".join(" --- " if key in ("run", "change") else " ---: " for key, _ in columns) + "|",
    ]
    for row in rows:
        cells = [fmt(row.get(key, NAN), key).replace("|", "\\|") for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sla_levels(rows: list[dict[str, Any]]) -> list[str]:
    levels = {k[3:].split("_", 1)[0] for row in rows for k in row if k.startswith("sla") and k[3:4].isdigit()}
    return sorted(levels, key=int)


def sla_table(rows: list[dict[str, Any]]) -> str:
    """TTFT p50/p99, TPOT p99 and SLO attainment per SLA class, one row per run."""
    columns = [("run", "run")]
    for level in sla_levels(rows):
        columns += [
            (f"sla{level}_ttft_p50_s", f"L{level} TTFT p50"),
            (f"sla{level}_ttft_p99_s", f"L{level} TTFT p99"),
            (f"sla{level}_tpot_p99_s", f"L{level} TPOT p99"),
            (f"sla{level}_slo_attainment", f"L{level} SLO att."),
        ]
    return markdown_table(rows, columns)


def results_markdown(
    plan_info: dict[str, Any], rows: list[dict[str, Any]], points: list[dict[str, Any]] | None = None
) -> str:
    """DIR/results.md: with seeds, the points with 95% intervals first; then the main table
    (one row per run), per-SLA-class latencies, what each arm changes, notes."""
    intervals = []
    if points is not None:
        intervals = [
            f"## Points: mean [95% interval] over seeds {plan_info.get('seeds')}",
            "",
            interval_table(points),
            "",
            "Per SLA class (higher level = more important):",
            "",
            sla_interval_table(points),
            "",
            "## Every run",
            "",
        ]
    lines = [
        f"# Ablation `{plan_info['name']}`",
        "",
        plan_info.get("description", "").strip(),
        "",
        f"Config `{plan_info['source']}`, commit `{plan_info.get('git_rev', '?')}`, "
        f"{len(rows)} runs, {plan_info.get('wall_s', 0):.0f} s wall with {plan_info.get('jobs')} jobs. "
        "Times are on the virtual clock (cost model of the target), so they are reproducible; "
        "'–' marks a metric that is undefined for that run (docs/experiments.md).",
        "",
        *intervals,
        markdown_table(rows, MD_COLUMNS),
        "",
        "## Latency per SLA class (higher level = more important)",
        "",
    ]
    lines += [sla_table(rows), "", "## Arms", ""]
    lines += [markdown_table(rows, [("run", "run"), ("parent", "parent"), ("change", "change")]), ""]
    notes = [(row["run"], row["notes"]) for row in rows if row.get("notes")]
    if notes:
        lines += ["## Notes", ""] + [f"- `{run}`: {note}" for run, note in notes] + [""]
    return "\n".join(lines)


def interval_cell(row: dict[str, Any], column: str) -> str:
    """`mean [lo, hi]` of a summary row's metric (bytes humanized), or the mean alone when
    there is no interval (one seed, or a count that is the same in every seed)."""
    mean = row.get(column, NAN)
    lo, hi = row.get(f"{column}_lo", NAN), row.get(f"{column}_hi", NAN)
    if isinstance(mean, float) and math.isnan(mean):
        return "–"
    if isinstance(lo, float) and math.isnan(lo):
        return fmt(float(mean), column) + (" (n=1)" if row.get("num_seeds") == 1 else "")
    if abs(float(hi) - float(lo)) <= 1e-9 * max(abs(float(mean)), 1e-300):  # the same in every seed
        return fmt(float(mean), column)
    return f"{fmt(float(mean), column)} [{fmt(float(lo), column)}, {fmt(float(hi), column)}]"


CI_COLUMNS = (
    ("run", "point"),
    ("num_seeds", "seeds"),
    ("goodput_req_s", "goodput req/s"),
    ("slo_attainment", "SLO att."),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tpot_p99_s", "TPOT p99 s"),
    ("num_preemptions", "preempt."),
    ("preemption_stall_s", "stall s"),
    ("stall_share", "stall share"),
    ("kv_bytes_moved", "moved"),
)


def interval_table(rows: list[dict[str, Any]], columns: Iterable[tuple[str, str]] = CI_COLUMNS) -> str:
    """Summary rows (experiments.aggregate) with `mean [lo, hi]` cells: 95% intervals."""
    columns = [(key, title) for key, title in columns if any(key in row for row in rows)]
    lines = [
        "| " + " | ".join(title for _, title in columns) + " |",
        "|" + "|".join(" --- " if key == "run" else " ---: " for key, _ in columns) + "|",
    ]
    for row in rows:
        cells = [
            str(row[key]) if key in ("run", "num_seeds") else interval_cell(row, key).replace("|", "\\|")
            for key, _ in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sla_interval_table(rows: list[dict[str, Any]]) -> str:
    """Goodput, TTFT p99 and TPOT p99 per SLA class with 95% intervals, one row per point."""
    columns = [("run", "point")]
    for level in sla_levels(rows):
        columns += [
            (f"sla{level}_goodput_req_s", f"L{level} goodput"),
            (f"sla{level}_ttft_p99_s", f"L{level} TTFT p99"),
            (f"sla{level}_tpot_p99_s", f"L{level} TPOT p99"),
        ]
    return interval_table(rows, columns)


def length_regime(rows: list[dict[str, Any]]) -> str:
    """What the runs' requests told the scheduler of their length, in words (every report,
    leaderboard section and Pareto plot says it: docs/design.md §1)."""
    modes = set()
    for row in rows:
        workload = (row.get("_config") or {}).get("workload") or {}
        mode = workload.get("max_tokens_mode", "trace")
        if mode == "fixed":
            modes.add(
                f"max_tokens as clients send it, a fixed cap of {workload.get('max_tokens_fixed', 1024)}"
            )
        elif mode == "noisy":
            modes.add(
                f"a noisy estimate of the true length (lognormal sigma {workload.get('max_tokens_noise')})"
            )
        else:
            modes.add("**oracle**: max_tokens is each request's true output length (`trace`)")
    return "; ".join(sorted(modes)) or "unknown (no run's config)"
