"""`preempt run`, `collect` and `lengths`: a workload through the engine, and what its
runs' requests fit.

Flags become config overrides here (`--trace` -> `workload.trace`, collect's
`--set features.KEY=VALUE` -> a FeatureConfig); the replay itself is preempt.replay's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preempt.core.config import ConfigError, EngineConfig
from preempt.core.config_files import load_config


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
    mode = workload.max_tokens_mode
    told = {"trace": "trace (the true length: an oracle)", "fixed": f"fixed at {workload.max_tokens_fixed}"}
    line += f" its rate, max_tokens {told.get(mode, mode)}"
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
    dataset = save_dataset(columns, info, args.features, progress=not args.no_progress)
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
