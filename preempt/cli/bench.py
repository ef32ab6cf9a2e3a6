"""`preempt bench` and `calibrate`: benchmarks (preempt.bench; `--windows` and `--http`
judged by experiments/) and the virtual clock's device profile (preempt.calibrate).

Which flags a benchmark takes is checked here, before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Benchmarks with their own table and flags, beside preempt.bench.BENCHMARKS: `fidelity`
# (the simulator against a real vLLM), `lengths` (judged by intervals over minutes),
# `peers` (another simulator beside ours).
JUDGED_BENCHMARKS = ("fidelity", "lengths", "peers")


def cmd_bench(args: argparse.Namespace) -> int:
    from preempt.bench import BENCHMARKS

    options = {
        key: getattr(args, key)
        for key in ("model", "plan", "prompts", "measured")
        if getattr(args, key) is not None
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
        "clock": {"measured"},
    }.get(args.name, set())
    flags = {"served_speed": "no-served-speed", "speed": "no-speed"}
    for key in options:
        if key not in takes:
            print(
                f"preempt: error: --{flags.get(key, key)} does not apply to `bench {args.name}`",
                file=sys.stderr,
            )
            return 2
    if args.vidur and args.name != "peers":
        print("preempt: error: --vidur applies to `bench peers` only", file=sys.stderr)
        return 2
    if args.real is not None and args.name != "fidelity":
        print("preempt: error: --real applies to `bench fidelity` only", file=sys.stderr)
        return 2
    if args.name == "fidelity":
        return _bench_fidelity(args, options)
    if args.name == "peers" and not args.vidur:
        print("preempt: error: `bench peers` needs a peer: --vidur", file=sys.stderr)
        return 2
    if args.shape is not None and not args.http:
        print("preempt: error: --shape applies to `bench vllm --http` only", file=sys.stderr)
        return 2
    if args.connector and not args.http and args.name != "fidelity":
        print(
            "preempt: error: --connector applies to `bench vllm --http` and `bench fidelity` only",
            file=sys.stderr,
        )
        return 2
    if args.connector and args.shape is not None:
        message = "--connector runs its own forced-preemption workloads: drop --shape"
        print(f"preempt: error: {message}", file=sys.stderr)
        return 2
    for flag, value in (
        ("trace", args.trace),
        ("arms", None if args.http else args.arms),
        ("max-tokens", args.max_tokens),
        ("lengths", args.lengths),
        ("modes", args.modes),
        ("out", args.out),
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
    for key, values in (
        ("model", models),
        ("plan", [options.get("plan")]),
        ("measured", [options.get("measured")]),
    ):
        for value in values:
            if value is not None and not Path(value).is_file():
                print(f"preempt: error: --{key}: no such file: {value}", file=sys.stderr)
                return 2
    from preempt.core.profiles import ProfileError
    from preempt.parity.harness import PeerError

    result: dict[str, Any]
    try:
        if args.http:  # experiments/ judges the seeds by intervals
            import tempfile

            from preempt.bench.vllm_http import bench_vllm_http
            from preempt.parity.harness import peer_python

            with tempfile.TemporaryDirectory(prefix="preempt-bench-vllm-http-") as tmp:
                if args.connector:
                    return _bench_connector(args, Path(tmp))
                from preempt.bench.vllm_http import ARMS

                shapes = ("mixed", "priority") if args.shape == "both" else (args.shape or "mixed",)
                names = args.arms.split(",") if args.arms is not None else [arm.name for arm in ARMS]
                unknown = sorted(set(names) - {arm.name for arm in ARMS})
                if unknown:
                    known = ", ".join(arm.name for arm in ARMS)
                    message = f"--arms: unknown {', '.join(unknown)} (known: {known})"
                    print(f"preempt: error: {message}", file=sys.stderr)
                    return 2
                arms = [arm for arm in ARMS if arm.name in names]
                result = bench_vllm_http(peer_python(None), Path(tmp), args.quick, arms, shapes)
        elif args.name == "peers":
            from preempt.bench.peers import bench_peers, render_peers, vidur_python

            result = bench_peers(vidur_python(), args.quick)
            if not args.json:
                print(render_peers(result))
                return 0
        elif args.name == "lengths":  # judged by intervals over minutes
            from preempt.bench.lengths import bench_lengths, render_lengths

            result = bench_lengths(args.quick)
            if not args.json:
                print(render_lengths(result))
                return 0
        elif args.windows:  # experiments/ judges the windows by intervals
            from preempt.bench.early_windows import bench_early_windows

            arms = args.arms.split(",") if args.arms is not None else None
            try:
                if arms is None and not models:  # every arm that needs no checkpoint
                    from preempt.bench.early_windows import WINDOW_ARMS

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
    except (PeerError, ProfileError) as err:  # bench vllm's peer; bench clock's --measured file
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2

    if args.windows:
        return _print_windows(result, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


def _bench_fidelity(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """`bench fidelity`: real vLLM, then calibrate, simulate, compare; the table (or the
    JSON) on stdout, everything in --out."""
    from preempt.bench.fidelity import bench_fidelity, rejudge, render_fidelity
    from preempt.core.profiles import ProfileError
    from preempt.parity.harness import PeerError, peer_python

    named = ("shape", "trace", "arms", "max_tokens", "lengths", "modes")
    flags = [*options, *(k for k in named if getattr(args, k) is not None)]
    flags += [k for k in ("windows", "http", "vidur") if getattr(args, k)]
    if flags:
        print(
            f"preempt: error: --{flags[0].replace('_', '-')} does not apply to `bench fidelity`",
            file=sys.stderr,
        )
        return 2
    out = args.out or Path("runs/fidelity")
    try:
        if args.real is not None:
            if args.connector:
                print(
                    "preempt: error: --real judges what the kept run holds: drop --connector", file=sys.stderr
                )
                return 2
            if not any((args.real / name).is_file() for name in ("real.json", "real.json.gz")):
                print(f"preempt: error: --real: no real.json in {args.real}", file=sys.stderr)
                return 2
            result = rejudge(args.real)
            out = args.real if args.out is None else out
        else:
            result = bench_fidelity(peer_python(None), out.resolve(), args.quick, connector=args.connector)
    except (PeerError, ProfileError) as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    table = render_fidelity(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fidelity.md").write_text(table + "\n")
    print(json.dumps(result) if args.json else table)
    print(f"wrote {out / 'fidelity.json'}, {out / 'fidelity.md'} and the calibrated {out / 'target.json'}",
          file=sys.stderr if args.json else sys.stdout)  # fmt: skip
    return 0


def _bench_connector(args: argparse.Namespace, work_dir: Path) -> int:
    """`bench vllm --http --connector`: the table per regime (or the JSON with --json)."""
    from preempt.bench.vllm_connector import CONNECTOR_ARMS, bench_vllm_connector, connector_table
    from preempt.parity.harness import peer_python

    names = args.arms.split(",") if args.arms is not None else [arm.name for arm in CONNECTOR_ARMS]
    unknown = sorted(set(names) - {arm.name for arm in CONNECTOR_ARMS})
    if unknown or "vllm" not in names:
        known = ", ".join(arm.name for arm in CONNECTOR_ARMS)
        problem = f"unknown {', '.join(unknown)}" if unknown else "vllm (the baseline) is needed"
        print(f"preempt: error: --arms: {problem} (known: {known})", file=sys.stderr)
        return 2
    arms = [arm for arm in CONNECTOR_ARMS if arm.name in names]
    result = bench_vllm_connector(peer_python(None), work_dir, args.quick, arms)
    print(json.dumps(result) if args.json else connector_table(result))
    return 0


def _print_windows(result: dict[str, Any], args: argparse.Namespace) -> int:
    """`bench early --windows`: the table on stdout and both written to `--out`, then the
    paths written. `--json`: the result alone on stdout, compact, and files only with an
    explicit `--out` (their paths on stderr): scripts run several at once, each to its own
    file, and must not race on the default folder."""
    from preempt.bench.early_windows import RESULTS_DIR, render_windows, write_windows

    if args.json and args.out is None:
        print(json.dumps(result))
        return 0
    out = args.out or RESULTS_DIR
    flags = [("--model", args.model), ("--trace", args.trace), ("--arms", args.arms)]
    flags += [("--max-tokens", args.max_tokens), ("--lengths", args.lengths), ("--modes", args.modes)]
    command = " ".join(
        ["preempt bench early --windows", *(["--quick"] if args.quick else [])]
        + [f"{flag} {value}" for flag, value in flags if value is not None]
        + [f"--out {out}"]
    )
    paths = write_windows(result, out, command)
    print(json.dumps(result) if args.json else render_windows(result))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from preempt.calibrate import command
    from preempt.core.profiles import ProfileError

    if (args.steps is not None) != (args.source == "vllm"):
        print("preempt: error: --from vllm takes its step logs with --steps LOG [LOG ...]", file=sys.stderr)
        return 2
    try:
        if args.source == "vllm":
            paths = [command.calibrate_vllm_steps(args.steps, args.out)]
        elif args.source == "vidur":
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
