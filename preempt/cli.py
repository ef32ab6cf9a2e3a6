"""The `preempt` command line (a *contract*, see DESIGN.md "CLI").

Owns: argument parsing, turning flags into config overrides, and exit codes. It does no
work itself: each command calls into the library. Bad flags and bad config end with one
line on stderr naming the flag or key, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preempt.config import ConfigError, EngineConfig, load_config
from preempt.workload import TraceError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


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
    return load_config(args.config, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from preempt.replay import replay  # heavy imports (torch) only when running

    config = _config_from_args(args)
    summary = replay(config, args.out, progress=not args.no_progress)
    keys = (
        "num_requests",
        "num_finished",
        "num_aborted",
        "num_preemptions",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "goodput_req_s",
        "sim_time_s",
        "wall_time_s",
    )
    print(json.dumps({k: summary[k] for k in keys}, indent=2))
    print(f"wrote {args.out / 'requests.parquet'} and {args.out / 'summary.json'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from preempt.bench import BENCHMARKS

    result: dict[str, Any] = BENCHMARKS[args.name](args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from preempt.bench import BENCHMARKS

    parser = _Parser(prog="preempt", description="Preemption in LLM inference serving: engine, experiments.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="replay a workload through one configuration")
    _add_workload_flags(run)
    run.set_defaults(func=cmd_run)

    from preempt.server import add_serve_arguments, cmd_serve  # fastapi, uvicorn: ~0.4 s

    serve = sub.add_parser("serve", help="HTTP server (OpenAI-compatible), engine on the wall clock")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="micro/macro benchmarks; one JSON object on stdout")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("--json", action="store_true", help="compact JSON on one line")
    bench.add_argument("--quick", action="store_true", help="smaller sizes (seconds, for smoke checks)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, TraceError) as err:  # bad input named by key, file or line
        print(f"preempt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
