"""What knowing each request's true output length would be worth to the projection: the
`projection` arm of `preempt bench early` with every request projected to end at its true
length (`Projection.end_of = Request.output_limit`, the oracle's privilege) beside the
plain projection (max_tokens) and the learned one (preempt.engine.lengths), on a trace's
held-out windows with max_tokens a fixed 1024; swap, async restores, hidden against the
window's synchronous `none`. The ceiling any output-length model could reach.

    python scripts/projection_ceiling.py [--trace azure-conv] [--max-tokens fixed]

Prints one JSON line per window and arm, then each arm's mean and 95% t-interval over the
windows. ~2 min a trace on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from preempt.bench.early import arm_overrides, hidden_share, run_arm, window_s
from preempt.bench.early_windows import choose_windows
from preempt.obs.stats import t_interval


def exact_lengths(engine) -> None:
    engine.early_saver.policy.projection.end_of = lambda request: request.output_limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument("--max-tokens", default="fixed", choices=["fixed", "noisy"])
    args = parser.parse_args()
    duration = window_s(quick=False)
    arms = ("projection", "projection_learned", "projection_exact")
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    regime = [f"workload.trace={args.trace}", f"workload.max_tokens_mode={args.max_tokens}"]
    with tempfile.TemporaryDirectory() as tmp:

        def run(arm: str, start: float, async_restore: bool = True, **kwargs) -> dict:
            name = "projection" if arm == "projection_exact" else arm
            overrides = arm_overrides("swap", name, None, start, duration, [], async_restore)
            return run_arm([*regime, *overrides], Path(tmp) / arm, **kwargs)

        for start in choose_windows(args.trace, duration, []):
            base = run("none", start, async_restore=False)
            for arm in arms:
                row = run(
                    arm,
                    start,
                    learned_lengths=arm == "projection_learned",
                    setup=exact_lengths if arm == "projection_exact" else None,
                )
                row["stall_hidden"] = hidden_share(row["stall_total_s"], base["stall_total_s"])
                rows[arm].append(row)
                print(
                    json.dumps(
                        {
                            "window_s": start,
                            "arm": arm,
                            "stall_hidden": row["stall_hidden"],
                            "waste_share": row["waste_share"],
                        }
                    ),
                    flush=True,
                )
    for arm, of_arm in rows.items():
        hidden = t_interval([r["stall_hidden"] for r in of_arm])
        waste = t_interval([r["waste_share"] for r in of_arm])
        print(
            f"== {args.trace} {args.max_tokens} {arm}: hidden {hidden.mean:.3f} [{hidden.lo:.3f}, "
            f"{hidden.hi:.3f}]  waste {waste.mean:.3f} [{waste.lo:.3f}, {waste.hi:.3f}]"
        )


if __name__ == "__main__":
    main()
