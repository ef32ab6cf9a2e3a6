"""The `preempt` command line (a *contract*, see docs/design.md "CLI").

Owns: argument parsing, turning flags into config overrides, and exit codes. It does no
work itself: each command calls into the library. Bad flags and bad config end with one
line on stderr naming the flag or key, and a non-zero exit.

Over 500 lines because every command's flags are declared here (the CLI contract in one
place); each command's body is a few lines calling the library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preempt.core.cli_args import ArgParser
from preempt.core.config import ConfigError, EngineConfig, load_config
from preempt.core.workload import TraceError


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = list(args.set)
    for flag, key in (
        ("trace", "workload.trace"),
        ("duration", "workload.duration_s"),
        ("rate_scale", "workload.rate_scale"),
        ("seed", "seed"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    config = load_config(args.config, overrides)
    args.workload_line = _workload_line(config, args.config, overrides)
    return config


def _workload_line(config: EngineConfig, path: Path | None, overrides: list[str]) -> str:
    """What was replayed, in one line (`run`'s and `collect`'s output), naming the window
    and rate keys that came from the config file rather than the command line (a config's
    4x rate and 60 s window otherwise ride along silently with a user's own --trace)."""
    workload = config.workload
    end = "its end" if workload.duration_s is None else f"{workload.start_s + workload.duration_s:g} s"
    line = f"{workload.trace} [{workload.start_s:g} s, {end}) at {workload.rate_scale:g}x"
    line += f" its rate, max_tokens {workload.max_tokens_mode}"
    if path is not None:
        given = {o.partition("=")[0].strip() for o in overrides}
        from_file = [
            f"{key}={getattr(workload, name)}"
            for name in ("start_s", "duration_s", "rate_scale", "num_requests", "arrival", "max_tokens_mode")
            if (key := f"workload.{name}") not in given and name in workload.model_fields_set
        ]
        if from_file:
            line += f" ({', '.join(from_file)} from {path})"
    return line


def cmd_run(args: argparse.Namespace) -> int:
    from preempt.replay import replay  # heavy imports (torch) only when running

    config = _config_from_args(args)
    summary = replay(config, args.out, progress=not args.no_progress)
    keys = (
        "num_requests",
        "num_finished",
        "num_aborted",
        "num_preemptions",
        "num_preemption_failed",
        "preemption_stall_s",
        "kv_saved_bytes_raw",
        "kv_saved_bytes_stored",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "goodput_req_s",
        "sim_time_s",
        "wall_time_s",
    )
    print(json.dumps({"workload": args.workload_line, **{k: summary[k] for k in keys}}, indent=2))
    print(f"wrote {args.out / 'requests.parquet'} and {args.out / 'summary.json'}")
    return 0


def _feature_config(args: argparse.Namespace) -> Any:
    """Take the collect-only `--set features.KEY=VALUE` overrides out of args.set (the
    engine config has no `features` section) into a FeatureConfig."""
    from preempt.obs.dataset import FeatureConfig

    engine_sets, values = [], {}
    for assignment in args.set:
        key, _, raw = assignment.partition("=")
        if not key.strip().startswith("features."):
            engine_sets.append(assignment)
            continue
        name = key.strip().removeprefix("features.")
        if name not in FeatureConfig.__dataclass_fields__:
            choices = ", ".join(FeatureConfig.__dataclass_fields__)
            raise ConfigError(f"unknown config key 'features.{name}'; choose one of {choices}")
        try:
            values[name] = FeatureConfig.parse(name, raw)
        except ValueError:
            raise ConfigError(f"config key 'features.{name}': not a number: '{raw}'") from None
    args.set = engine_sets
    try:
        return FeatureConfig(**values)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def cmd_collect(args: argparse.Namespace) -> int:
    import time

    from preempt.obs.dataset import FeatureLogger, save_dataset
    from preempt.replay import replay

    feature_config = _feature_config(args)
    config = _config_from_args(args)
    if feature_config.feature_set == "forecast" and config.clock.kind != "virtual":
        raise ConfigError(
            "config key 'features.feature_set': 'forecast' forks the engine every few steps and "
            "needs clock.kind 'virtual' (a fork cannot replay real time)"
        )
    logger = FeatureLogger(feature_config)
    views = []

    def on_step(view: Any, output: Any) -> None:
        if not views:
            views.append(view)  # the run's read-only view: its records label the rows
        logger(view, output)

    summary = replay(config, args.out, progress=not args.no_progress, on_step=on_step)
    started = time.perf_counter()
    records = list(views[0].records) if views else []
    columns = logger.columns(records)
    info = {
        "trace": config.workload.trace,
        "seed": config.seed,
        **feature_config.meta(),
        "num_preemptions": summary["num_preemptions"],
        "sim_time_s": summary["sim_time_s"],
        "config": config.model_dump(mode="json"),
    }
    dataset = save_dataset(columns, info, args.features)
    num_rows = len(dataset)
    print(
        json.dumps(
            {
                "workload": args.workload_line,
                "num_requests": summary["num_requests"],
                "num_preemptions": summary["num_preemptions"],
                "num_rows": num_rows,
                "num_positive": int(columns["label"].sum()),
                "positive_rate": float(columns["label"].mean()) if num_rows else None,
                "sim_time_s": summary["sim_time_s"],
                "replay_wall_s": summary["wall_time_s"],
                "dataset_wall_s": time.perf_counter() - started,
            },
            indent=2,
        )
    )
    print(
        f"wrote {args.out / 'requests.parquet'}, {args.out / 'summary.json'} and the dataset {args.features}"
    )
    return 0


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
    return 0


def cmd_eval_predictor(args: argparse.Namespace) -> int:
    import torch

    from predictor.data import DataError
    from predictor.evaluate import evaluate_checkpoint, jsonable
    from preempt.engine.online_predictor import PredictorCheckpointError, load_checkpoint

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
    print(json.dumps(jsonable(report)))
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


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """The served tiny model's tokenizer as a Hugging Face directory: token id i is byte
    i, as `preempt.model.tokenizer.ByteTokenizer` (an `hf` checkpoint's directory already
    holds its own). Load generators count tokens with it, offline."""
    from preempt.model.tokenizer import write_byte_tokenizer

    try:
        write_byte_tokenizer(args.out)
    except ImportError as err:
        return _missing(f"preempt tokenizer needs {err.name} (pip install tokenizers): {err}")
    except OSError as err:
        print(f"preempt tokenizer: error: cannot write {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'tokenizer.json'} and {args.out / 'tokenizer_config.json'}")
    return 0


def cmd_lengths(args: argparse.Namespace) -> int:
    """Fit the output-length model (preempt.engine.lengths) on runs' finished requests:
    `early_save.length_model` for the projection policy. Each run's trace window (from
    its summary.json's config) is recorded, so a bench can avoid it."""
    from preempt.core.workload import trace_window
    from preempt.engine.lengths import LengthModel

    windows = []
    for run in args.runs:
        try:
            window = trace_window(json.loads((run / "summary.json").read_text()))
        except (OSError, ValueError):
            window = None  # a run without its summary: its window is not known
        if window is not None:
            windows.append(window)
    try:
        model = LengthModel.from_requests([run / "requests.parquet" for run in args.runs], windows)
        model.save(args.out)
    except ValueError as err:
        print(f"preempt lengths: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"preempt lengths: error: cannot write {args.out}: {err.strerror}", file=sys.stderr)
        return 2
    print(json.dumps({"num_requests": model.num_requests, "num_cells": len(model.cells), "windows": windows}))
    print(f"wrote {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from preempt.bench import BENCHMARKS

    options = {
        key: getattr(args, key) for key in ("model", "plan", "prompts") if getattr(args, key) is not None
    }
    if args.no_served_speed:
        options["served_speed"] = False
    if args.no_speed:
        options["speed"] = False
    if args.windows:
        options["windows"] = True
    if args.http:
        options["http"] = True
    takes = {
        "codec": {"model", "plan", "served_speed", "speed", "prompts"},
        "early": {"model", "windows"},
        "vllm": {"http"},
    }.get(args.name, set())
    flags = {"served_speed": "no-served-speed", "speed": "no-speed"}
    for key in options:
        if key not in takes:
            print(
                f"preempt: error: --{flags.get(key, key)} does not apply to `bench {args.name}`",
                file=sys.stderr,
            )
            return 2
    for flag, value in (
        ("trace", args.trace),
        ("arms", args.arms),
        ("max-tokens", args.max_tokens),
        ("lengths", args.lengths),
        ("modes", args.modes),
    ):
        if value is not None and not args.windows:
            print(f"preempt: error: --{flag} applies to `bench early --windows` only", file=sys.stderr)
            return 2
    lstm_asked = args.arms is None or any(arm.startswith("lstm") for arm in args.arms.split(","))
    if args.windows and "model" not in options and args.arms is not None and lstm_asked:
        print(
            "preempt: error: --windows with lstm arms needs --model (predictor checkpoints, comma-separated)",
            file=sys.stderr,
        )
        return 2
    # --windows takes several checkpoints (training seeds), comma-separated.
    if args.windows:
        models = options["model"].split(",") if "model" in options else []
    else:
        models = [options.get("model")]
    for key, values in (("model", models), ("plan", [options.get("plan")])):
        for value in values:
            if value is not None and not Path(value).is_file():
                print(f"preempt: error: --{key}: no such file: {value}", file=sys.stderr)
                return 2
    from preempt.parity.harness import PeerError

    result: dict[str, Any]
    try:
        if args.http:  # experiments/ judges the seeds by intervals
            import tempfile

            from experiments.vllm_http import bench_vllm_http
            from preempt.parity.harness import peer_python

            with tempfile.TemporaryDirectory(prefix="preempt-bench-vllm-http-") as tmp:
                result = bench_vllm_http(peer_python(None), Path(tmp), args.quick)
        elif args.windows:  # experiments/ judges the windows by intervals
            from experiments.early_windows import bench_early_windows

            arms = args.arms.split(",") if args.arms is not None else None
            try:
                if arms is None and not models:  # every arm that needs no checkpoint
                    from experiments.early_windows import WINDOW_ARMS

                    arms = [arm for arm in WINDOW_ARMS if not arm.startswith("lstm")]
                if args.lengths is not None and not Path(args.lengths).is_file():
                    print(f"preempt: error: --lengths: no such file: {args.lengths}", file=sys.stderr)
                    return 2
                result = bench_early_windows(
                    args.quick,
                    models,
                    args.trace or "azure-conv",
                    arms,
                    args.max_tokens,
                    args.lengths,
                    *([tuple(args.modes.split(","))] if args.modes else []),
                )
            except ValueError as err:  # an unknown --arms or --trace, or no free windows
                print(f"preempt: error: {err}", file=sys.stderr)
                return 2
        else:
            result = BENCHMARKS[args.name](args.quick, **options)
    except PeerError as err:  # bench vllm: no peer virtualenv, it failed, or `vllm serve` did
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from preempt.calibrate import command
    from preempt.core.cost_model import ProfileError

    try:
        if args.source == "vidur":
            paths = command.calibrate_vidur(args.out)
        elif args.source is not None:
            paths = [command.calibrate_file(Path(args.source), args.out, args.base)]
        elif args.device is not None:
            paths = [command.calibrate_device(args.device, args.tiny, args.out, args.base)]
        else:
            print("preempt: error: calibrate needs --from vidur|FILE or --device cuda", file=sys.stderr)
            return 2
    except ProfileError as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"wrote": [str(p) for p in paths]}))
    return 0


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
        policies = {None: None, "both": ["fcfs", "priority"]}.get(args.policy, [args.policy])
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

    paper = f" --paper {args.paper}" if args.paper else ""
    paper += "".join(f" --sweep {path}" for path in args.sweep)
    paper += f" --early {args.early}" if args.early else ""
    paper += "".join(f" --compare {arm}" for arm in args.compare)
    command = f"preempt report --quick {args.quick}{paper} --out {args.out}"
    try:
        path = report(
            args.quick,
            args.out,
            paper=args.paper,
            command=command,
            sweeps=args.sweep,
            early=args.early,
            compare=args.compare,
        )
    except FileNotFoundError as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _missing(message: str) -> int:
    print(f"preempt: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    from preempt.bench import BENCHMARKS

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
    train.add_argument("--max-epochs", type=_positive_int, help="passes over the train split (12)")
    train.add_argument(
        "--seq-len",
        type=_positive_int,
        help="backprop truncation, in logged steps of a request's history (256)",
    )
    train.add_argument("--batch-size", type=_positive_int, help="rows per batch, whole histories (1024)")
    train.add_argument("--lr", type=float, help="Adam learning rate (1e-2)")
    train.add_argument("--seed", type=int, help="seeds the split, the weights and the shuffle (0)")
    train.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (never blocks on the network)",
    )
    train.add_argument("--num-threads", type=_positive_int, help="torch threads (1)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--accelerator", help="Lightning accelerator: cpu (default), gpu, auto")
    train.add_argument(
        "--devices", type=_positive_int, help="devices (processes on CPU) training together (1)"
    )
    train.add_argument("--strategy", help="Lightning strategy, e.g. ddp or ddp_spawn (auto)")
    train.add_argument("--num-nodes", type=_positive_int, help="machines training together (1)")
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
        "eval-predictor", help="evaluate a checkpoint and the baselines; one JSON object"
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
    evaluate.add_argument("--num-threads", type=_positive_int, default=1, help="torch threads (default 1)")
    evaluate.set_defaults(func=cmd_eval_predictor)

    lm = sub.add_parser("lm", help="the reference LM (tiny model trained on Python's stdlib)")
    lm_sub = lm.add_subparsers(dest="lm_command", required=True, parser_class=ArgParser)
    lm_train = lm_sub.add_parser("train", help="train it (Lightning); cached when DIR/lm.pt has this config")
    lm_train.add_argument(
        "--out", type=Path, default=Path("runs/lm"), help="writes lm.pt, metrics.json (runs/lm)"
    )
    # Defaults (None here) live in preempt.lm.train.LMTrainConfig; the help repeats them.
    lm_train.add_argument("--preset", help="architecture: lm-4l (default), tiny-2l, small-4l")
    lm_train.add_argument("--layers", type=_positive_int, help="override the preset's num_layers")
    lm_train.add_argument("--hidden", type=_positive_int, help="override hidden_size")
    lm_train.add_argument("--heads", type=_positive_int, help="override num_heads (query heads)")
    lm_train.add_argument("--kv-heads", type=_positive_int, help="override num_kv_heads")
    lm_train.add_argument("--head-dim", type=_positive_int, help="override head_dim")
    lm_train.add_argument("--intermediate", type=_positive_int, help="override intermediate_size")
    lm_train.add_argument("--seq-len", type=_positive_int, help="bytes per training window (256)")
    lm_train.add_argument("--batch-size", type=_positive_int, help="windows per step (16)")
    lm_train.add_argument("--max-steps", type=_positive_int, help="optimizer steps (500)")
    lm_train.add_argument("--max-minutes", type=float, help="wall-clock cap (15)")
    lm_train.add_argument("--lr", type=float, help="peak AdamW learning rate (3e-3)")
    lm_train.add_argument("--seed", type=int, help="seeds the weights and the windows (0)")
    lm_train.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (never blocks on the network)",
    )
    lm_train.add_argument("--num-threads", type=_positive_int, help="torch threads (default: torch's)")
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
    importance.add_argument("--calib-bytes", type=_positive_int, help="validation bytes scored (65536)")
    importance.add_argument(
        "--eval-bytes", type=_positive_int, help="test bytes of the masking check (65536)"
    )
    importance.add_argument(
        "--seq-len", type=_positive_int, help="window bytes (default: the model's training)"
    )
    importance.add_argument("--seed", type=int, help="calibration windows and random masks (0)")
    importance.add_argument("--num-random", type=_positive_int, help="random masks averaged (8)")
    importance.add_argument(
        "--normalize",
        choices=("layer", "none"),
        help="none (default: raw scores, ranked across layers) or layer (per-layer L2, as Michel et al.)",
    )
    importance.add_argument(
        "--single-head", action="store_true", help="also mask each KV head alone and rank-correlate"
    )
    importance.add_argument("--num-threads", type=_positive_int, default=1, help="torch threads (default 1)")
    importance.set_defaults(func=cmd_importance)

    serve = sub.add_parser("serve", help="HTTP server (OpenAI-compatible), engine on the wall clock")
    try:
        from preempt.serve import add_serve_arguments, cmd_serve  # fastapi, uvicorn: ~0.4 s
    except ImportError as err:
        # Where the server's packages are missing (the offline GPU machine), every other
        # command still runs; `serve` says what is missing instead of the CLI failing whole.
        serve.set_defaults(
            func=lambda _args, err=err: _missing(f"preempt serve needs {err.name}: {err}"), any_flags=True
        )
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=cmd_serve)

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

    bench = sub.add_parser("bench", help="micro/macro benchmarks; one JSON object on stdout")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", action="store_true", help="compact JSON on one line")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (seconds, for smoke checks)")
    bench.add_argument(
        "--model", help="codec: a trained tiny LM (lm.pt); early: a predictor checkpoint for the lstm policy"
    )
    bench.add_argument("--plan", help="codec: a head plan file (preempt importance writes one)")
    bench.add_argument(
        "--windows",
        action="store_true",
        help="early: the async arms on every held-out trace window, with intervals (--model may "
        "list several checkpoints, comma-separated: training seeds)",
    )
    bench.add_argument(
        "--trace",
        help="early --windows: the trace replayed, a bundled name (azure-conv, azure-code, "
        "mooncake-synthetic) or an Azure CSV / Mooncake JSONL path (default azure-conv); its "
        "windows avoid every window the checkpoints were trained on",
    )
    bench.add_argument(
        "--arms",
        help="early --windows: the arms to run beside the synchronous none baseline, comma-separated "
        "(lookahead, rule, forecast, forecast_k4, projection, projection_learned, lstm, lstm_capped; "
        "default all; without --model, those without lstm)",
    )
    bench.add_argument(
        "--lengths",
        help="early --windows: the projection_learned arm's output-length model (`preempt lengths` "
        "writes one; default: fitted on the trace outside each window)",
    )
    bench.add_argument(
        "--modes",
        help="early --windows: the preemption modes, comma-separated (swap, swap_zstd; default both)",
    )
    bench.add_argument(
        "--max-tokens",
        choices=["fixed", "noisy", "trace"],
        help="early --windows: what clients send as max_tokens (workload.max_tokens_mode; default "
        "collect.yaml's fixed 1024; trace: the true output length, an oracle's privilege)",
    )
    bench.add_argument(
        "--http",
        action="store_true",
        help="vllm: the peer's own `vllm serve` per arm (fcfs, priority, the plugin), driven over HTTP",
    )
    bench.add_argument(
        "--no-served-speed",
        action="store_true",
        help="codec: skip the speed section at a served model's KV shape (minutes)",
    )
    bench.add_argument(
        "--no-speed",
        action="store_true",
        help="codec: quality and size per plan only, no CPU speed columns (the main job's step)",
    )
    bench.add_argument(
        "--prompts",
        type=_positive_int,
        help="codec: held-out prompts each plan's quality is measured on (16)",
    )
    bench.set_defaults(func=cmd_bench)

    calibrate = sub.add_parser("calibrate", help="fit the virtual clock's device profile (docs/clock.md)")
    calibrate.add_argument(
        "--from", dest="source", help="`vidur`: the bundled Vidur profiles; or a measurement JSON to fit"
    )
    calibrate.add_argument("--device", choices=["cuda"], help="measure this GPU (a Llama-3-8B-shaped stack)")
    calibrate.add_argument("--tiny", action="store_true", help="--device: toy shape (CPU without CUDA)")
    calibrate.add_argument("--base", default="h200", help="profile for what is not measured (all-reduce)")
    calibrate.add_argument(
        "--out", type=Path, required=True, help="profile JSON (--from vidur: a directory for a100/h100/h200)"
    )
    calibrate.set_defaults(func=cmd_calibrate)

    ablate = sub.add_parser("ablate", help="run an ablation matrix (experiments/configs/*.yaml)")
    ablate.add_argument("--config", type=Path, required=True, help="e.g. experiments/configs/quick.yaml")
    ablate.add_argument("--out", type=Path, required=True, help="writes results.csv, results.md, plots/")
    ablate.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (never blocks on the network)",
    )
    ablate.add_argument("--jobs", type=_positive_int, help="arms run at once (default: min(cores, arms))")
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
        choices=("fcfs", "priority", "both"),
        help="vLLM's scheduling policy (ours: vllm_fcfs / vllm_priority); default: each workload's own",
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

    report = sub.add_parser("report", help="docs/results.md from ablation outputs (claims, measured, held?)")
    report.add_argument("--quick", type=Path, required=True, help="output directory of the quick ablation")
    report.add_argument("--paper", type=Path, help="output directory of the paper ablation")
    report.add_argument(
        "--sweep", type=Path, action="append", default=[], help="a regime sweep's output dir (repeatable)"
    )
    report.add_argument(
        "--early", type=Path, help="a `preempt bench early --windows --json` result: early saves side by side"
    )
    report.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="ARM",
        help="an arm of your own, judged against every named baseline by the design's paired tests "
        "(repeatable; the ablations must have run it)",
    )
    report.add_argument("--out", type=Path, default=Path("docs/results.md"), help="(docs/results.md)")
    report.set_defaults(func=cmd_report)

    tune = sub.add_parser(
        "tune", help="tune an arm's knobs with Optuna (TPE) on ablation runs; one JSON line (docs/tuning.md)"
    )
    tune.add_argument("--config", type=Path, required=True, help="e.g. experiments/configs/tune.yaml")
    tune.add_argument("--out", type=Path, required=True, help="writes study.json, best.yaml, trials/")
    tune.add_argument("--trials", type=_positive_int, help="trials in all (default: the config's `trials`)")
    tune.add_argument("--jobs", type=_positive_int, help="runs at once (default: min(cores, a batch's runs))")
    tune.add_argument(
        "--ray-address",
        help="run the trials' runs as tasks on this Ray cluster (e.g. ray://head:10001 or auto); "
        "default: Ray on this machine with --jobs CPUs (one job: in this process)",
    )
    tune.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="default: online if WANDB_API_KEY is set, else offline (never blocks on the network)",
    )
    tune.add_argument(
        "--resume",
        action="store_true",
        help="reuse runs with the same config's metrics (the study replays the same trials)",
    )
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ConfigError, TraceError) as err:  # bad input named by key, file or line
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
