"""How often the cheap forecast (preempt.early.projection) names the preemptions the
fork's forecast (preempt.early.lookahead, knows_future=False) names, and what each costs.

Replays collect.yaml's workload (raw swap, no early saves, so the live run is what both
forecast) on trace windows and, every `--every` steps, asks both for the requests the
scheduler preempts within the horizon (50 ms, as the predictor's labels). Prints, per
window and in all: the fork's predicted preemptions, the share the projection also names
(agreement: issue target >= 0.95), the projection's own extra names (share of what it
names), and the host time per call of each.

Usage: python scripts/projection_agreement.py [--trace azure-conv] [--starts 1600,1800,2000,2200]
       [--duration 200] [--every 4] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from preempt.bench.early import COLLECT
from preempt.core.config_files import load_config
from preempt.early.lookahead import Lookahead
from preempt.early.projection import Projection
from preempt.replay import replay

HORIZON_MS = 50.0


def one_window(trace: str, start: float, duration: float, every: int, sets: list[str]) -> dict:
    overrides = [
        f"workload.trace={trace}",
        f"workload.start_s={start}",
        f"workload.duration_s={duration}",
        "preemption.mode=swap",
        *sets,
    ]
    config = load_config(COLLECT, overrides)
    fork = Lookahead(HORIZON_MS, knows_future=False)
    cheap = Projection(HORIZON_MS)
    totals = {"fork": 0, "both": 0, "cheap": 0, "calls": 0}

    def on_step(view, output) -> None:
        if view.num_steps % every or not view.running:
            return
        want = fork.within(fork.forecast(view))
        got = cheap.within(cheap.forecast(view, output.step_s))
        totals["calls"] += 1
        totals["fork"] += len(want)
        totals["cheap"] += len(got)
        totals["both"] += len(want & got)

    with tempfile.TemporaryDirectory() as tmp:
        replay(config, Path(tmp), progress=False, on_step=on_step)
    calls = max(totals["calls"], 1)
    return {
        "window_s": [start, start + duration],
        **totals,
        "agreement": totals["both"] / totals["fork"] if totals["fork"] else None,
        "extra_share": (totals["cheap"] - totals["both"]) / totals["cheap"] if totals["cheap"] else None,
        "fork_ms_per_call": 1000 * fork.wall_s / calls,
        "cheap_ms_per_call": 1000 * cheap.wall_s / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument("--starts", default="1600,1800,2000,2200")
    parser.add_argument("--duration", type=float, default=200.0)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    rows = [
        one_window(args.trace, float(s), args.duration, args.every, args.sets) for s in args.starts.split(",")
    ]
    fork = sum(r["fork"] for r in rows)
    both = sum(r["both"] for r in rows)
    cheap = sum(r["cheap"] for r in rows)
    print(
        json.dumps(
            {
                "trace": args.trace,
                "windows": rows,
                "agreement": both / fork if fork else None,
                "extra_share": (cheap - both) / cheap if cheap else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
