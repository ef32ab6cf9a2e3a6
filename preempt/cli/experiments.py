"""`preempt ablate`, `tune`, `report` and `parity vllm`: studies over many runs
(experiments/) and step-by-step parity with vLLM's scheduler (preempt.parity).

Each prints its summary and exits 1 when a study's own check failed (an arm, every
trial, a differing step); bad input exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_ablate(args: argparse.Namespace) -> int:
    from experiments.ablate import ablate  # torch only in the arms
    from experiments.tables import MD_COLUMNS, interval_table, markdown_table

    result = ablate(
        args.config,
        args.out,
        wandb=args.wandb,
        jobs=args.jobs,
        predictor=args.predictor,
        overrides=args.set,
        only=args.arms.split(",") if args.arms else None,
        resume=args.resume,
        ray_address=args.ray_address,
    )
    if result.points is not None:
        print(interval_table(result.points))
    else:
        print(markdown_table(result.rows, MD_COLUMNS[:10]))
    print(f"wrote {args.out / 'results.csv'}, {args.out / 'results.md'} and {len(result.plots)} plots")
    if result.info.get("wandb_sync"):
        print(result.info["wandb_sync"])
    if result.num_failed:
        print(f"preempt: error: {result.num_failed} arm(s) failed (see results.md)", file=sys.stderr)
        return 1
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from experiments.tune import tune  # optuna and torch only here

    command = f"preempt tune --config {args.config} --out {args.out}"
    command += f" --trials {args.trials}" if args.trials else ""
    result = tune(
        args.config,
        args.out,
        trials=args.trials,
        jobs=args.jobs,
        ray_address=args.ray_address,
        wandb=args.wandb,
        resume=args.resume,
        command=command,
    )
    print(json.dumps(result.summary))
    if result.best is None:
        print(f"preempt: error: every trial failed (see {args.out / 'study.json'})", file=sys.stderr)
        return 1
    return 0


def cmd_parity_vllm(args: argparse.Namespace) -> int:
    from preempt.parity.harness import PeerError, run_parity, summary_lines
    from preempt.parity.workload import WorkloadError, bundled_names, load_workload

    if args.list:
        print("\n".join(bundled_names()))
        return 0
    names = args.workload or (bundled_names() if args.bundled else [])
    if not names:
        print("preempt parity vllm: error: give --workload FILE (repeatable) or --bundled", file=sys.stderr)
        return 2
    try:
        workloads = [load_workload(name) for name in names]
        policies = {None: None, "both": ["fcfs", "priority"], "all": ["fcfs", "priority", "lcf"]}.get(
            args.policy, [args.policy]
        )
        report = run_parity(workloads, policies, args.set, python=args.peer_python, trace_dir=args.traces)
    except (WorkloadError, PeerError) as err:
        print(f"preempt parity vllm: error: {err}", file=sys.stderr)
        return 2
    if args.summary:
        print("\n".join(summary_lines(report)), file=sys.stderr)
    print(json.dumps(report, indent=None if args.json else 1))
    return 0 if report["identical"] else 1


def cmd_report(args: argparse.Namespace) -> int:
    from experiments.report import report

    paper = f" --headline {args.headline}" if args.headline else ""
    paper += f" --paper {args.paper}" if args.paper else ""
    paper += "".join(f" --sweep {path}" for path in args.sweep)
    paper += f" --early {args.early}" if args.early else ""
    paper += f" --codec {args.codec}" if args.codec else ""
    paper += "".join(f" --compare {arm}" for arm in args.compare)
    paper += f" --multiplicity {args.multiplicity}" if args.multiplicity != "bh" else ""
    paper += f" --leaderboard {args.leaderboard}" if args.leaderboard else ""
    command = f"preempt report --quick {args.quick}{paper} --out {args.out}"
    try:
        paths = report(
            args.quick,
            args.out,
            paper=args.paper,
            command=command,
            sweeps=args.sweep,
            early=args.early,
            compare=args.compare,
            codec=args.codec,
            headline=args.headline,
            multiplicity=args.multiplicity,
            leaderboard=args.leaderboard,
        )
    except (FileNotFoundError, FileExistsError) as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}{'/' if path.is_dir() else ''}")
    return 0
