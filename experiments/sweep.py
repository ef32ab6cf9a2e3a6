"""The program a wandb sweep runs: one arm of an ablation with the sweep's parameters.

    wandb sweep preempt/configs/sweep.yaml          # prints SWEEP_ID (needs wandb online)
    wandb agent ENTITY/PROJECT/SWEEP_ID                 # on as many machines as you like

Each agent asks the wandb server for the next parameters and starts
`python experiments/sweep.py --ablation F --arm NAME --preemption.threshold=0.3 ...`.
This program validates the arm's config with those dotted overrides (applied after the
arm's own, so they win), replays it on the virtual clock, and logs the ablation metrics
(`goodput_req_s`, the sweep's objective, and the rest) to the run the agent opened. The
distribution across machines is wandb's own (server-side controller, one agent per
machine): there is no layer of ours in between.

Owns: turning agent arguments into overrides, and the one-arm run. Without an agent it
runs the same way (`--wandb offline|disabled`), which is how the tests use it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preempt.core.config import ConfigError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="experiments/sweep.py",
        description="Run one ablation arm with dotted overrides (--a.b=v) and log its metrics to wandb.",
    )
    parser.add_argument(
        "--ablation", type=Path, required=True, help="ablation config (preempt/configs/*.yaml)"
    )
    parser.add_argument(
        "--arm", required=True, help="the arm to run (its overrides apply before the sweep's)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/sweep"), help="run files go to OUT/<wandb run id>"
    )
    parser.add_argument("--metric", default="goodput_req_s", help="the sweep's objective (also printed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="base overrides")
    parser.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (an agent's run is online)",
    )
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:  # the agent's ${args}: --preemption.threshold=0.3
        if not item.startswith("--") or "=" not in item:
            parser.error(f"expected --dotted.key=value, got '{item}'")
        overrides.append(item[2:])
    return args, overrides


def run(argv: list[str]) -> dict[str, Any]:
    from experiments.execution import init_worker
    from experiments.measure import run_metrics
    from experiments.plan import plan_ablation
    from preempt.obs.tracking import resolve_wandb_mode
    from preempt.replay import replay

    args, overrides = parse_args(argv)
    mode = resolve_wandb_mode(args.wandb)
    plan = plan_ablation(
        args.ablation, args.out, overrides=args.set, only=[args.arm], final_overrides=overrides
    )
    arm = plan.runs[0]
    if arm.reference is not None or len(plan.runs) != 1:
        raise ConfigError(f"--arm {args.arm}: a sweep runs one arm without a grid or a reference arm")
    if arm.skip_reason is not None:
        raise ConfigError(f"--arm {args.arm}: {arm.skip_reason}")
    wb = None
    run_id = "local"
    if mode != "disabled":
        import wandb

        args.out.mkdir(parents=True, exist_ok=True)
        wb = wandb.init(
            project=plan.config.wandb_project,
            job_type="sweep",
            dir=str(args.out),
            mode=mode,
            config={"arm": args.arm, "engine": arm.config.model_dump(mode="json"), "overrides": overrides},
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, init_timeout=15.0),
        )
        run_id = wb.id
    init_worker()
    run_dir = args.out / run_id
    summary = replay(arm.config, run_dir, progress=False)
    metrics = run_metrics(run_dir, summary)
    if args.metric not in metrics:
        raise ConfigError(f"--metric: unknown metric '{args.metric}'")
    if wb is not None:
        clean = {k: v for k, v in metrics.items() if not (isinstance(v, float) and v != v)}
        wb.log(clean)
        wb.summary.update(clean)
        wb.finish()
    return {
        "arm": args.arm,
        "overrides": overrides,
        args.metric: metrics[args.metric],
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    try:
        print(json.dumps(run(sys.argv[1:] if argv is None else argv)))
    except ConfigError as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
