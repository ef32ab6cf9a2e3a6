"""Every `preempt` command's flags, the CLI contract in one place (the server's are
preempt.serve's own): `build_parser()`, which docs/reference/cli.md is generated from.
Each command's body lives in the module of its role (engine, train, serve, bench,
experiments); the parser only points at it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from preempt.cli.bench import add_bench_parser, cmd_calibrate
from preempt.cli.engine import cmd_collect, cmd_lengths, cmd_run
from preempt.cli.experiments import cmd_ablate, cmd_parity_vllm, cmd_report, cmd_tune
from preempt.cli.serve import add_serve_command, cmd_checkpoint, cmd_tokenizer
from preempt.cli.train import cmd_eval_predictor, cmd_importance, cmd_lm_train, cmd_train
from preempt.core.cli_args import ArgParser, positive_int


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON or YAML engine config")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--trace", help="bundled trace (azure-conv, azure-code, mooncake-synthetic) or a path"
    )
    parser.add_argument("--duration", type=float, help="seconds of the trace to replay (workload.duration_s)")
    parser.add_argument("--rate-scale", type=float, help="arrival-rate multiplier (workload.rate_scale)")
    parser.add_argument("--seed", type=int, help="seed of model init, prompts, SLA mix, sampling")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set scheduler.max_num_seqs=64 (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got '{text}'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got '{text}'")
    return value


def _add_wandb_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (never blocks on the network)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(
        prog="preempt", description="Preemption in LLM inference serving: engine, experiments."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgParser)

    run = sub.add_parser("run", help="replay a workload through one configuration")
    _add_workload_flags(run)
    run.set_defaults(func=cmd_run)

    collect = sub.add_parser("collect", help="replay like `run` and log features + labels for the predictor")
    _add_workload_flags(collect)
    collect.add_argument(
        "--features",
        type=Path,
        required=True,
        help="output directory of the features dataset (datasets.load_from_disk); "
        "--set features.every_k_steps=K / features.horizon_ms=MS tune it",
    )
    collect.set_defaults(func=cmd_collect)

    train = sub.add_parser("train", help="train the LSTM preemption predictor (Lightning)")
    train.add_argument("--data", type=Path, required=True, help="features dataset from `preempt collect`")
    train.add_argument("--out", type=Path, required=True, help="writes predictor.ckpt and metrics.json")
    # Defaults (None here) live in predictor.train.TrainConfig, which this parser must not
    # import (pytorch_lightning); the help repeats them.
    train.add_argument("--max-epochs", type=positive_int, help="passes over the train split (12)")
    train.add_argument(
        "--seq-len",
        type=positive_int,
        help="backprop truncation, in logged steps of a request's history (256)",
    )
    train.add_argument("--batch-size", type=positive_int, help="rows per batch, whole histories (1024)")
    train.add_argument("--lr", type=float, help="Adam learning rate (1e-2)")
    train.add_argument("--seed", type=int, help="seeds the split, the weights and the shuffle (0)")
    _add_wandb_flag(train)
    train.add_argument("--num-threads", type=positive_int, help="torch threads (1)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--accelerator", help="Lightning accelerator: cpu (default), gpu, auto")
    train.add_argument(
        "--devices", type=positive_int, help="devices (processes on CPU) training together (1)"
    )
    train.add_argument("--strategy", help="Lightning strategy, e.g. ddp or ddp_spawn (auto)")
    train.add_argument("--num-nodes", type=positive_int, help="machines training together (1)")
    train.add_argument(
        "--threshold-rule",
        choices=("waste_capped", "expected_value", "f1"),
        help="how the online threshold is chosen on val (waste_capped: the most save stall avoided "
        "with at most --max-waste-share of early-copied bytes wasted; docs/predictor.md)",
    )
    train.add_argument(
        "--max-waste-share", type=_share, help="waste_capped: the cap on val's wasted share (0.3)"
    )
    train.set_defaults(func=cmd_train)

    evaluate = sub.add_parser(
        "eval-predictor", help="evaluate a checkpoint and the baselines: a table (--json: the whole report)"
    )
    evaluate.add_argument("--ckpt", type=Path, required=True, help="predictor.ckpt from `preempt train`")
    evaluate.add_argument("--data", type=Path, required=True, help="features dataset")
    evaluate.add_argument(
        "--split",
        choices=("train", "val", "test", "all"),
        default="test",
        help="rows to report (split as in training; all: every row, with --source-data)",
    )
    evaluate.add_argument(
        "--source-data",
        type=Path,
        help="the dataset the checkpoint was trained on: thresholds and logreg come from it, "
        "--data is only scored (distribution shift)",
    )
    evaluate.add_argument("--num-threads", type=positive_int, default=1, help="torch threads (default 1)")
    evaluate.add_argument(
        "--json", action="store_true", help="the whole report (every metric, per trace) as JSON on one line"
    )
    evaluate.set_defaults(func=cmd_eval_predictor)

    lm = sub.add_parser("lm", help="the reference LM (tiny model trained on Python's stdlib)")
    lm_sub = lm.add_subparsers(dest="lm_command", required=True, parser_class=ArgParser)
    lm_train = lm_sub.add_parser("train", help="train it (Lightning); cached when DIR/lm.pt has this config")
    lm_train.add_argument(
        "--out", type=Path, default=Path("runs/lm"), help="writes lm.pt, metrics.json (runs/lm)"
    )
    # Defaults (None here) live in preempt.lm.train.LMTrainConfig; the help repeats them.
    lm_train.add_argument("--preset", help="architecture: lm-4l (default), tiny-2l, small-4l")
    lm_train.add_argument("--layers", type=positive_int, help="override the preset's num_layers")
    lm_train.add_argument("--hidden", type=positive_int, help="override hidden_size")
    lm_train.add_argument("--heads", type=positive_int, help="override num_heads (query heads)")
    lm_train.add_argument("--kv-heads", type=positive_int, help="override num_kv_heads")
    lm_train.add_argument("--head-dim", type=positive_int, help="override head_dim")
    lm_train.add_argument("--intermediate", type=positive_int, help="override intermediate_size")
    lm_train.add_argument("--seq-len", type=positive_int, help="bytes per training window (256)")
    lm_train.add_argument("--batch-size", type=positive_int, help="windows per step (16)")
    lm_train.add_argument("--max-steps", type=positive_int, help="optimizer steps (500)")
    lm_train.add_argument("--max-minutes", type=float, help="wall-clock cap (15)")
    lm_train.add_argument("--lr", type=float, help="peak AdamW learning rate (3e-3)")
    lm_train.add_argument("--seed", type=int, help="seeds the weights and the windows (0)")
    _add_wandb_flag(lm_train)
    lm_train.add_argument("--num-threads", type=positive_int, help="torch threads (default: torch's)")
    lm_train.add_argument("--force", action="store_true", help="retrain even when cached")
    lm_train.add_argument("--no-progress", action="store_true", help="no progress bar")
    lm_train.set_defaults(func=cmd_lm_train)

    importance = sub.add_parser(
        "importance", help="gradient head importance (Michel et al. 2019) -> a mixed-precision head plan"
    )
    importance.add_argument("--model", type=Path, required=True, help="lm.pt from `preempt lm train`")
    importance.add_argument(
        "--out", type=Path, required=True, help="plan JSON; scores go to <stem>.scores.json beside it"
    )
    importance.add_argument("--fp8-share", type=float, help="share of KV heads saved FP8 (0.5)")
    importance.add_argument("--drop-share", type=float, help="share of KV heads dropped (0.1)")
    importance.add_argument("--calib-bytes", type=positive_int, help="validation bytes scored (65536)")
    importance.add_argument("--eval-bytes", type=positive_int, help="test bytes of the masking check (65536)")
    importance.add_argument(
        "--seq-len", type=positive_int, help="window bytes (default: the model's training)"
    )
    importance.add_argument("--seed", type=int, help="calibration windows and random masks (0)")
    importance.add_argument("--num-random", type=positive_int, help="random masks averaged (8)")
    importance.add_argument(
        "--normalize",
        choices=("layer", "none"),
        help="none (default: raw scores, ranked across layers) or layer (per-layer L2, as Michel et al.)",
    )
    importance.add_argument(
        "--single-head", action="store_true", help="also mask each KV head alone and rank-correlate"
    )
    importance.add_argument("--num-threads", type=positive_int, default=1, help="torch threads (default 1)")
    importance.set_defaults(func=cmd_importance)

    serve = sub.add_parser("serve", help="HTTP server (OpenAI-compatible), engine on the wall clock")
    add_serve_command(serve)  # preempt.serve's flags, or a line naming what is missing

    checkpoint = sub.add_parser(
        "checkpoint",
        help="write a random-weight Llama checkpoint vLLM serves from a directory, offline (its text "
        "is noise)",
    )
    checkpoint.add_argument("--out", type=Path, required=True, help="the directory (kept if it holds one)")
    checkpoint.add_argument(
        "--preset",
        default="fidelity",
        choices=("tiny", "served", "fidelity"),
        help="tiny: 0.2M parameters; served: 3M, byte tokenizer; fidelity (default): 27M float32, "
        "where recomputing a prefill costs (bench fidelity)",
    )
    checkpoint.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    checkpoint.set_defaults(func=cmd_checkpoint)

    tokenizer = sub.add_parser(
        "tokenizer",
        help="write the tiny model's byte-level tokenizer (tokenizer.json) for load generators",
    )
    tokenizer.add_argument("--out", type=Path, required=True, help="a directory; guidellm's --processor")
    tokenizer.set_defaults(func=cmd_tokenizer)

    lengths = sub.add_parser(
        "lengths", help="fit the output-length model on runs' finished requests (early_save.length_model)"
    )
    lengths.add_argument(
        "runs", nargs="+", type=Path, help="run directories (`preempt run`/`collect --out`: requests.parquet)"
    )
    lengths.add_argument("--out", type=Path, required=True, help="the model file to write (lengths.json)")
    lengths.set_defaults(func=cmd_lengths)

    add_bench_parser(sub)

    calibrate = sub.add_parser("calibrate", help="fit the virtual clock's device profile (docs/clock.md)")
    calibrate.add_argument(
        "--from",
        dest="source",
        help="`vidur`: the bundled Vidur profiles; `vllm`: a real vLLM's steps (--steps); or a "
        "measurement JSON to fit",
    )
    calibrate.add_argument(
        "--steps",
        nargs="+",
        type=Path,
        metavar="LOG",
        help="--from vllm: step logs vLLM wrote with preempt's step logger (--scheduler-cls "
        "preempt.integrations.vllm.steplog.StepLogScheduler --additional-config "
        "'{\"step_log\": PATH}'); writes a target profile (--out) that clock.target loads",
    )
    calibrate.add_argument("--device", choices=["cuda"], help="measure this GPU (a Llama-3-8B-shaped stack)")
    calibrate.add_argument("--tiny", action="store_true", help="--device: toy shape (CPU without CUDA)")
    calibrate.add_argument("--base", default="h200", help="profile for what is not measured (all-reduce)")
    calibrate.add_argument(
        "--out",
        type=Path,
        required=True,
        help="profile JSON (--from vidur: a directory for a100/h100/h200; --from vllm: a target file)",
    )
    calibrate.set_defaults(func=cmd_calibrate)

    ablate = sub.add_parser("ablate", help="run an ablation matrix (preempt/configs/*.yaml)")
    ablate.add_argument("--config", type=Path, required=True, help="e.g. preempt/configs/quick.yaml")
    ablate.add_argument("--out", type=Path, required=True, help="writes results.csv, results.md, plots/")
    _add_wandb_flag(ablate)
    ablate.add_argument("--jobs", type=positive_int, help="arms run at once (default: min(cores, arms))")
    ablate.add_argument("--predictor", help="predictor.ckpt for early_lstm arms (else they are skipped)")
    ablate.add_argument("--arms", help="run only these arms (comma-separated)")
    ablate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a base key")
    ablate.add_argument("--resume", action="store_true", help="reuse runs with the same config's metrics")
    ablate.add_argument(
        "--ray-address",
        help="run the arms as tasks on this Ray cluster (e.g. ray://head:10001 or auto); default: "
        "Ray on this machine with --jobs CPUs (one job: in this process)",
    )
    ablate.set_defaults(func=cmd_ablate)

    parity = sub.add_parser("parity", help="step-by-step parity with a real scheduler (optional peer)")
    parity_sub = parity.add_subparsers(dest="parity_command", required=True, parser_class=ArgParser)
    parity_vllm = parity_sub.add_parser(
        "vllm",
        help="drive vLLM 0.32's own V1 scheduler and ours on the same workloads; JSON report, "
        "exit 1 when any step differs",
    )
    parity_vllm.add_argument(
        "--workload",
        action="append",
        help="a workload file (JSON/YAML, docs/parity.md) or a bundled name; repeatable",
    )
    parity_vllm.add_argument("--bundled", action="store_true", help="every bundled workload")
    parity_vllm.add_argument("--list", action="store_true", help="list the bundled workloads and exit")
    parity_vllm.add_argument(
        "--policy",
        choices=("fcfs", "priority", "lcf", "both", "all"),
        help="vLLM's scheduling policy (ours: vllm_fcfs / vllm_priority); lcf: its FCFS with RFC #54644's "
        "victim patched into its own scheduler source (ours: vllm_lcf); both: fcfs and priority; all: the "
        "three; default: each workload's own",
    )
    parity_vllm.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of OUR engine only, e.g. scheduler.reserve_full_sequence=false",
    )
    parity_vllm.add_argument("--peer-python", help="the peer virtualenv's python (default .peer/bin/python)")
    parity_vllm.add_argument("--traces", type=Path, help="also write both step traces here (JSON lines)")
    parity_vllm.add_argument("--summary", action="store_true", help="one line per run on stderr")
    parity_vllm.add_argument("--json", action="store_true", help="compact JSON on one line")
    parity_vllm.set_defaults(func=cmd_parity_vllm)

    report = sub.add_parser(
        "report", help="the results page from ablation outputs (claims, measured, held?; docs/results.md)"
    )
    report.add_argument(
        "--quick",
        type=Path,
        required=True,
        help="output directory of the main ablation (the quick one, or any; labelled by its config's name)",
    )
    report.add_argument("--paper", type=Path, help="output directory of the paper ablation")
    report.add_argument(
        "--headline",
        type=Path,
        help="output directory of the headline ablation (preempt/configs/headline.yaml): it opens the "
        "page (which policy per regime, every class, the design against every baseline)",
    )
    report.add_argument(
        "--leaderboard",
        type=Path,
        help="where the leaderboard goes (every policy at every point; its Pareto plots in the folder "
        "of its stem); default leaderboard.md beside --out; one another report wrote is never overwritten",
    )
    report.add_argument(
        "--multiplicity",
        choices=("bh", "holm", "none"),
        default="bh",
        help="the correction over the family of the report's verdicts: Benjamini-Hochberg (false "
        "discovery rate 5%%, default), Holm (family-wise error 5%%) or none",
    )
    report.add_argument(
        "--sweep", type=Path, action="append", default=[], help="a regime sweep's output dir (repeatable)"
    )
    report.add_argument(
        "--early",
        type=Path,
        help="a `preempt bench early --windows` result (its result.json, or what --json prints): early "
        "saves side by side",
    )
    report.add_argument(
        "--codec",
        type=Path,
        help="a `preempt bench codec --json` result on the trained LM (--model): the codec budget claim "
        "is judged from it, paired by prompt (else not measured)",
    )
    report.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="ARM",
        help="an arm of your own, judged against every named baseline by the design's paired tests "
        "(repeatable; the ablations must have run it)",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=Path("runs/report/results.md"),
        help="the report; its plots go to the folder of its stem, leaderboard.md and leaderboard/ "
        "beside it (runs/report/results.md; the published page: --out docs/results.md)",
    )
    report.set_defaults(func=cmd_report)

    tune = sub.add_parser(
        "tune", help="tune an arm's knobs with Optuna (TPE) on ablation runs; one JSON line (docs/tuning.md)"
    )
    tune.add_argument("--config", type=Path, required=True, help="e.g. preempt/configs/tune.yaml")
    tune.add_argument("--out", type=Path, required=True, help="writes study.json, best.yaml, trials/")
    tune.add_argument("--trials", type=positive_int, help="trials in all (default: the config's `trials`)")
    tune.add_argument("--jobs", type=positive_int, help="runs at once (default: min(cores, a batch's runs))")
    tune.add_argument(
        "--ray-address",
        help="run the trials' runs as tasks on this Ray cluster (e.g. ray://head:10001 or auto); "
        "default: Ray on this machine with --jobs CPUs (one job: in this process)",
    )
    _add_wandb_flag(tune)
    tune.add_argument(
        "--resume",
        action="store_true",
        help="reuse runs with the same config's metrics (the study replays the same trials)",
    )
    tune.set_defaults(func=cmd_tune)
    return parser
