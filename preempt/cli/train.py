"""`preempt train`, `eval-predictor`, `lm train` and `importance`: the LSTM predictor
(predictor/, Lightning) and the reference LM with its head plan (preempt.lm, torch).

pytorch_lightning costs ~5 s to import: every library import is inside its command.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def cmd_train(args: argparse.Namespace) -> int:
    from predictor.data import DataError
    from predictor.train import NoThresholdError, TrainConfig, train  # pytorch_lightning: ~5 s

    given = {
        name: getattr(args, name)
        for name in (
            "max_epochs",
            "seq_len",
            "batch_size",
            "lr",
            "seed",
            "num_threads",
            "accelerator",
            "devices",
            "strategy",
            "num_nodes",
            "threshold_rule",
            "max_waste_share",
        )
        if getattr(args, name) is not None
    }
    config = TrainConfig(**given, wandb=args.wandb, progress=not args.no_progress)
    try:
        metrics = train(args.data, args.out, config)
    except DataError as err:
        print(f"preempt: error: --data: {err}", file=sys.stderr)
        return 2
    except NoThresholdError as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    if not metrics:  # a non-zero DDP rank: rank 0 reports
        return 0
    keys = ("auroc", "auprc", "precision", "recall", "f1", "threshold", "mean_lead_time_s", "event_recall")
    print(
        json.dumps({k: metrics.get(k) for k in (*keys, "best_val_auprc", "fit_wall_s", "wall_s")}, indent=2)
    )
    print(f"wrote {args.out / 'predictor.ckpt'} and {args.out / 'metrics.json'}")
    run_dir = metrics.get("wandb_run_dir")
    if run_dir and metrics.get("wandb") == "offline":
        print(f"wandb (offline): {run_dir}; upload it with: wandb sync {run_dir}")
    elif run_dir:
        print(f"wandb ({metrics.get('wandb')}): {run_dir}")
    return 0


def cmd_eval_predictor(args: argparse.Namespace) -> int:
    import torch

    from predictor.data import DataError
    from predictor.evaluate import evaluate_checkpoint, jsonable, render_evaluation
    from preempt.early.online_predictor import PredictorCheckpointError, load_checkpoint

    torch.set_num_threads(args.num_threads)
    try:
        load_checkpoint(args.ckpt)  # a clear error before Lightning's
    except PredictorCheckpointError as err:
        print(f"preempt: error: --ckpt: {err}", file=sys.stderr)
        return 2
    try:
        report = evaluate_checkpoint(args.ckpt, args.data, split=args.split, source=args.source_data)
    except (DataError, ValueError) as err:
        print(f"preempt: error: --data: {err}", file=sys.stderr)
        return 2
    print(json.dumps(jsonable(report)) if args.json else render_evaluation(report))
    return 0


def _lm_train_config(args: argparse.Namespace) -> Any:
    from preempt.lm.train import LMTrainConfig  # torch, not Lightning

    arch = {
        name: getattr(args, flag)
        for flag, name in (
            ("layers", "num_layers"),
            ("hidden", "hidden_size"),
            ("heads", "num_heads"),
            ("kv_heads", "num_kv_heads"),
            ("head_dim", "head_dim"),
            ("intermediate", "intermediate_size"),
        )
        if getattr(args, flag) is not None
    }
    given = {
        name: getattr(args, name)
        for name in (
            "preset",
            "seq_len",
            "batch_size",
            "max_steps",
            "max_minutes",
            "lr",
            "seed",
            "num_threads",
        )
        if getattr(args, name) is not None
    }
    return LMTrainConfig(**given, arch=arch, wandb=args.wandb, progress=not args.no_progress)


def cmd_lm_train(args: argparse.Namespace) -> int:
    from preempt.lm.train import LM_FILE, train_lm

    try:
        config = _lm_train_config(args)
    except ValueError as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    metrics = train_lm(args.out, config, force=args.force)
    if metrics["cached"]:
        print(
            f"cached: {args.out / LM_FILE} already holds this config (key {config.key()}); --force retrains"
        )
    keys = (
        "test_bpb",
        "val_bpb",
        "steps",
        "completed",
        "tokens_seen",
        "train_wall_s",
        "num_params",
        "cached",
    )
    print(json.dumps({k: metrics.get(k) for k in keys}, indent=2))
    if not metrics["cached"]:
        print(f"wrote {args.out / LM_FILE} and {args.out / 'metrics.json'}")
    return 0


def cmd_importance(args: argparse.Namespace) -> int:
    import torch

    from preempt.lm.importance import ImportanceConfig, run_importance, scores_path
    from preempt.model.checkpoint import read_tiny_lm

    given = {
        name: getattr(args, name)
        for name in ("fp8_share", "drop_share", "calib_bytes", "eval_bytes", "seq_len", "seed", "num_random")
        if getattr(args, name) is not None
    }
    if args.normalize is not None:
        given["normalize"] = args.normalize
    try:
        config = ImportanceConfig(**given, single_head=args.single_head)
        read_tiny_lm(args.model)
    except ValueError as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    if args.out.is_dir():
        print(f"preempt: error: --out: {args.out} is a directory; give the plan's file name", file=sys.stderr)
        return 2
    torch.set_num_threads(args.num_threads)
    report = run_importance(args.model, args.out, config)
    masking = report["masking"]
    summary = {
        "plan": report["plan_layers"],
        "kv_head_scores": [[round(x, 4) for x in row] for row in report["kv_head_scores"]],
        "masking_bpb": {k: masking[k]["bpb"] for k in ("none", "least", "random", "most")},
        "random_bpb_std": masking["random"]["bpb_std"],
        "num_masked": masking["num_masked"],
        "least_below_random": masking["least_below_random"],
        "random_below_most": masking["random_below_most"],
        "corpus_matches_training": report["corpus"]["matches_training"],
    }
    if report["single_head"] is not None:
        summary["single_head_delta_bpb"] = report["single_head"]["delta_bpb"]
        summary["single_head_rank_correlation"] = report["single_head"]["rank_correlation"]
    print(json.dumps(summary))
    print(f"wrote {args.out} and {scores_path(args.out)}", file=sys.stderr)  # stdout: the JSON alone
    return 0
