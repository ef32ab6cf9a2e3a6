"""The regime map: where KV moves are a real share of time, from a sweep's summary.csv.

    python -m experiments.regimes runs/regimes          # markdown on stdout (docs/regimes.md)

Owns: one table with a row per grid point of the sweep (target, prompt scale, copy link,
...) and, per arm, the stall share (`preemption_stall_s / sim_time_s`: the share of the
run the GPU waited on KV saves and restores) with its 95% interval, plus goodput of each
arm against the recompute arm (`rate_limit`, the design without saving) and what early
saves won back (each `early_*` arm against its parent, paired by seed).

Must never: hold a typed number (everything is read from the sweep's files).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from experiments.tables import interval_cell, read_csv
from preempt.obs.stats import t_interval

RECOMPUTE, RAW = "rate_limit", "swap_raw"


def _by_point(rows: list[dict[str, Any]], columns: list[str]) -> dict[tuple, dict[str, dict[str, Any]]]:
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(tuple(row[c] for c in columns), {})[row["arm"]] = row
    return out


def _paired(runs: list[dict[str, Any]], a: str, b: str, point: tuple, columns: list[str], metric: str):
    """Interval over seeds of metric(a) - metric(b) at one point, paired by seed."""
    values = {}
    for row in runs:
        if tuple(row[c] for c in columns) == point and row["status"] == "ok":
            values.setdefault(row["arm"], {})[row["seed"]] = row[metric]
    common = sorted(set(values.get(a, {})) & set(values.get(b, {})))
    return t_interval([values[a][s] - values[b][s] for s in common])


def regime_table(out_dir: Path) -> str:
    summary = read_csv(out_dir / "summary.csv")
    runs = read_csv(out_dir / "results.csv")
    import json

    grid = json.loads((out_dir / "ablation.json").read_text())["grid"]
    columns = [key.rsplit(".", 1)[-1] for key in grid]
    arms = list(dict.fromkeys(row["arm"] for row in summary))
    saving = [arm for arm in arms if arm != RECOMPUTE]
    head = [*columns, *(f"{arm} stall share" for arm in saving)]
    head += [f"{arm} save ms p50" for arm in saving if arm == RAW]
    if RECOMPUTE in arms and RAW in arms:
        head.append(f"goodput {RAW} - {RECOMPUTE} (req/s)")
    early = {
        row["arm"]: row["parent"].split("@", 1)[0]
        for row in summary
        if row["arm"].startswith("early_") and row["parent"].split("@", 1)[0] in arms
    }
    head += [f"stall {arm} - {parent} (s)" for arm, parent in early.items()]
    # Async restores take the copy-in out of the batch: the readmitted request waits instead.
    waiting = [arm for arm in saving if arm in (RAW, "swap_zstd")]
    head += [f"{arm} restore wait (s)" for arm in waiting]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for point, by_arm in _by_point(summary, columns).items():
        cells = [str(v) for v in point]
        cells += [interval_cell(by_arm[arm], "stall_share") if arm in by_arm else "–" for arm in saving]
        cells += [interval_cell(by_arm[RAW], "save_ms_p50") for arm in saving if arm == RAW]
        if RECOMPUTE in arms and RAW in arms:
            cells.append(_paired(runs, RAW, RECOMPUTE, point, columns, "goodput_req_s").format())
        for arm, parent in early.items():
            cells.append(_paired(runs, arm, parent, point, columns, "preemption_stall_s").format())
        cells += [interval_cell(by_arm[arm], "preemption_restore_wait_s") for arm in waiting]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (Path(argv[0]) / "summary.csv").is_file():
        print("usage: python -m experiments.regimes SWEEP_DIR (with summary.csv: an ablation with seeds)",
              file=sys.stderr)  # fmt: skip
        return 2
    print(regime_table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
