"""`preempt bench` and `calibrate`: benchmarks (preempt.bench; `--windows` and `--http`
judged by experiments/) and the virtual clock's device profile (preempt.calibrate).

Each benchmark is a subcommand with only its own flags (`add_bench_parser`), so argparse
refuses a flag another benchmark takes; what argparse cannot say (a flag that needs
another, files that must exist) is checked here, before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preempt.core.cli_args import LeafParser, positive_int

# Benchmarks with their own table and flags, beside preempt.bench.BENCHMARKS: `fidelity`
# (the simulator against a real vLLM), `lengths` (judged by intervals over minutes),
# `peers` (another simulator beside ours).
JUDGED_BENCHMARKS = ("fidelity", "lengths", "peers")

# What each measures, for `preempt bench --help` (docs/benchmarks.md has the results).
BENCH_HELP = {
    "clock": "the virtual clock's layer times against Vidur's measured operator times (fitted, held out)",
    "codec": "the KV codecs: size and CPU speed; with --model, quality per head plan on a trained LM",
    "early": "early saves: save stall hidden and bytes wasted per policy; --windows: held-out trace "
    "windows with intervals",
    "engine": "replay speed: the null hour and 10 pressured minutes per standard policy",
    "fidelity": "the simulator against a real vLLM 0.32 (`vllm serve`) on the same requests",
    "kernels": "the Triton kernels beside their torch references",
    "lengths": "the learned output-length estimate against the max_tokens cap on held-out minutes",
    "peers": "another simulator beside preempt on the same requests (--vidur)",
    "predictor": "the predictor's and its features' cost per engine step",
    "save": "saving and restoring a request's KV, per mode",
    "serve": "the HTTP server under load",
    "vllm": "preempt's policies inside vLLM's scheduler against vLLM's own (--http: real `vllm serve`)",
}


# Every flag any benchmark takes, as it reads where a benchmark does not take it: cmd_bench
# asks each namespace the same questions, whichever subcommand parsed it.
_UNSET = {
    **dict.fromkeys(("model", "plan", "prompts", "measured", "trace", "arms", "lengths", "modes")),
    **dict.fromkeys(("max_tokens", "out", "real", "shape")),
    **dict.fromkeys(("no_served_speed", "no_speed", "windows", "http", "connector", "vidur"), False),
}


def add_bench_parser(sub: Any) -> None:
    """`preempt bench NAME [flags]`: one subcommand per benchmark, each with its flags."""
    from preempt.bench import BENCHMARKS

    bench = sub.add_parser(
        "bench",
        help="micro/macro benchmarks; one JSON object on stdout (early --windows, lengths, peers: a table)",
    )
    names = bench.add_subparsers(dest="name", required=True, metavar="NAME", parser_class=LeafParser)
    parsers = {}
    for name in sorted([*BENCHMARKS, *JUDGED_BENCHMARKS]):
        parser = parsers[name] = names.add_parser(name, help=BENCH_HELP[name], description=BENCH_HELP[name])
        parser.add_argument("--json", action="store_true", help="compact JSON on one line")
        parser.add_argument(
            "--quick",
            action="store_true",
            help="smaller sizes, for smoke checks (seconds; early --windows: minutes, see --windows)",
        )
        parser.set_defaults(func=cmd_bench, **_UNSET)
    codec, early, vllm = parsers["codec"], parsers["early"], parsers["vllm"]
    codec.add_argument("--model", help="a trained tiny LM (lm.pt): quality per plan")
    codec.add_argument("--plan", help="a head plan file (preempt importance writes one)")
    codec.add_argument(
        "--no-served-speed",
        action="store_true",
        help="skip the speed section at a served model's KV shape (minutes)",
    )
    codec.add_argument(
        "--no-speed",
        action="store_true",
        help="quality and size per plan only, no CPU speed columns (the main job's step)",
    )
    codec.add_argument(
        "--prompts", type=positive_int, help="held-out prompts each plan's quality is measured on (16)"
    )
    parsers["clock"].add_argument(
        "--measured",
        help="also score the bundled profile of the GPU a `preempt calibrate --device cuda` run "
        "measured against that run's GEMM and elementwise times (its output file)",
    )
    early.add_argument(
        "--model",
        help="a predictor checkpoint for the lstm policy (--windows: several, comma-separated: "
        "training seeds)",
    )
    early.add_argument(
        "--windows",
        action="store_true",
        help="the async arms on every held-out trace window, with intervals; prints a table, writes "
        "it and the result to --out. Minutes: with --quick (2 windows of 60 s, no --model) 2.0 to 4.3 "
        "min measured on a shared 2-core machine; without --quick, 4 windows of 200 s",
    )
    early.add_argument(
        "--trace",
        help="--windows: the trace replayed, a bundled name (azure-conv, azure-code, "
        "mooncake-synthetic) or an Azure CSV / Mooncake JSONL path (default azure-conv); its "
        "windows avoid every window the checkpoints were trained on",
    )
    early.add_argument(
        "--arms",
        help="--windows: the arms to run beside the synchronous none baseline, comma-separated "
        "(lookahead, rule, forecast, forecast_k4, projection, projection_learned, lstm, lstm_capped; "
        "default all; without --model, those without lstm)",
    )
    early.add_argument(
        "--lengths",
        help="--windows: the projection_learned arm's output-length model (`preempt lengths` writes "
        "one; default: fitted on the trace outside each window)",
    )
    early.add_argument(
        "--modes", help="--windows: the preemption modes, comma-separated (swap, swap_zstd; default both)"
    )
    early.add_argument(
        "--max-tokens",
        choices=["fixed", "noisy", "trace"],
        help="--windows: what clients send as max_tokens (workload.max_tokens_mode; default "
        "collect.yaml's fixed 1024; trace: the true output length, an oracle's privilege)",
    )
    early.add_argument(
        "--out",
        type=Path,
        help="--windows: the folder it writes result.json (what --json prints) and results.md (the "
        "table) to (runs/bench/early_windows; with --json, none unless given)",
    )
    vllm.add_argument(
        "--http",
        action="store_true",
        help="the peer's own `vllm serve` per arm (fcfs, priority, the plugin), driven over HTTP",
    )
    vllm.add_argument(
        "--arms", help="--http: the servers, comma-separated (vllm_fcfs, vllm_priority, plugin; default all)"
    )
    vllm.add_argument(
        "--shape",
        choices=["mixed", "priority", "both"],
        help="--http: the workload (preempt.bench.vllm_http.SHAPES): mixed (default; 48-token "
        "priority-3 requests, the urgent class right behind them), priority (200-token priority-3 "
        "requests keep the pool under memory pressure, the urgent class every 0.4 s from 3 s), or both",
    )
    vllm.add_argument(
        "--connector",
        action="store_true",
        help="--http: preempt's KV connector against vLLM's recompute under forced preemptions "
        "(preempt.bench.vllm_connector: plain vLLM, the plugin, the plugin with raw / mixed copies and "
        "early copies; long and short prompts): tokens recomputed, latency, TTFT, throughput with 95%% "
        "intervals (about 6 min; --quick 3 min)",
    )
    fidelity = parsers["fidelity"]
    fidelity.add_argument(
        "--out",
        type=Path,
        help="the folder for the step logs, the client's records (real.json), the calibrated "
        "target.json, fidelity.json and fidelity.md (default runs/fidelity)",
    )
    fidelity.add_argument(
        "--real",
        type=Path,
        metavar="DIR",
        help="judge the real runs a bench left in DIR again (calibrate, simulate, compare; no "
        "servers, seconds)",
    )
    fidelity.add_argument(
        "--connector",
        action="store_true",
        help="also the judge windows through vLLM FCFS with preempt's KV connector (raw, mixed) "
        "against its recompute, beside the simulator's prediction of the same gain",
    )
    fidelity.add_argument(
        "--loads",
        action="store_true",
        help="instead: the judge windows through vLLM FCFS with preempt's KV connector (raw), "
        "synchronous loads against asynchronous ones, interleaved: step times, resume steps, the "
        "victims' stream gaps (preempt.bench.vllm_loads; about 10 min; --quick: a smoke run on the "
        "tiny model); with --real DIR, judge such a run again",
    )
    parsers["peers"].add_argument(
        "--vidur",
        action="store_true",
        help="Vidur 0.0.26 (`make vidur`) beside preempt on the same azure-conv requests, Llama-3-70B "
        "on 2 A100s: wall time, peak RSS, latency percentiles, preemptions (the hour: a few minutes; "
        "--quick: its first 10 minutes); prints a table",
    )


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
    if args.name == "fidelity":
        return _bench_fidelity(args)
    if args.name == "peers" and not args.vidur:
        print("preempt: error: `bench peers` needs a peer: --vidur", file=sys.stderr)
        return 2
    for flag, value in (("arms", args.arms), ("shape", args.shape), ("connector", args.connector or None)):
        if args.name == "vllm" and value is not None and not args.http:
            print(f"preempt: error: --{flag} applies to `bench vllm --http` only", file=sys.stderr)
            return 2
    if args.connector and args.shape is not None:
        message = "--connector runs its own forced-preemption workloads: drop --shape"
        print(f"preempt: error: {message}", file=sys.stderr)
        return 2
    for flag, value in (
        ("trace", args.trace),
        ("arms", None if args.name == "vllm" else args.arms),
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
    if args.name == "early":  # its one option beside --windows: the checkpoint
        options = {"model": options["model"]} if "model" in options and not args.windows else {}
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


def _bench_fidelity(args: argparse.Namespace) -> int:
    """`bench fidelity`: real vLLM, then calibrate, simulate, compare (`--loads`: the
    connector's asynchronous against synchronous loads); the table (or the JSON) on
    stdout, everything in --out."""
    from preempt.parity.harness import peer_python

    if args.loads:
        from preempt.bench.vllm_loads import bench_loads, rejudge_loads, render_loads

        if args.connector:
            print("preempt: error: --loads runs its own connector arms: drop --connector", file=sys.stderr)
            return 2

        def run_loads(out: Path) -> dict:
            return bench_loads(peer_python(None), out, args.quick)

        return _kept_bench(args, "loads", run_loads, rejudge_loads, render_loads)
    from preempt.bench.fidelity import bench_fidelity, rejudge, render_fidelity

    if args.real is not None and args.connector:
        print("preempt: error: --real judges what the kept run holds: drop --connector", file=sys.stderr)
        return 2

    def run(out: Path) -> dict:
        return bench_fidelity(peer_python(None), out, args.quick, connector=args.connector)

    return _kept_bench(args, "fidelity", run, rejudge, render_fidelity, " and the calibrated target.json")


def _kept_bench(args: argparse.Namespace, stem: str, run, rejudge, render, also: str = "") -> int:
    """A bench that keeps its real runs in --out (`run(out)`), or judges kept ones again
    (`--real DIR`: `rejudge(DIR)`); writes <stem>.json and <stem>.md beside them and
    prints the table (or the JSON)."""
    from preempt.core.profiles import ProfileError
    from preempt.parity.harness import PeerError

    out = args.out or Path(f"runs/{stem}")
    try:
        if args.real is not None:
            if not any((args.real / name).is_file() for name in ("real.json", "real.json.gz")):
                print(f"preempt: error: --real: no real.json in {args.real}", file=sys.stderr)
                return 2
            result = rejudge(args.real)
            out = args.real if args.out is None else out
        else:
            result = run(out.resolve())
    except (PeerError, ProfileError) as err:
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2
    table = render(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    print(json.dumps(result) if args.json else table)
    written = f"wrote {out / f'{stem}.json'}, {out / f'{stem}.md'}{also}"
    print(written, file=sys.stderr if args.json else sys.stdout)
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
