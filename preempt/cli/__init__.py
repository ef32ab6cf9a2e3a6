"""The `preempt` command line (a *contract*, see docs/design.md "CLI").

Owns: argument parsing, turning flags into config overrides, and exit codes. It does no
work itself: each command calls into the library. Bad flags and bad config end with one
line on stderr naming the flag or key, and a non-zero exit.

Commands by role: engine (run, collect, lengths), train (train, eval-predictor, lm,
importance), serve (serve, tokenizer), bench (bench, calibrate), experiments (ablate,
tune, report, parity); parser holds every command's flags. Library imports (torch,
pytorch_lightning, the server's packages) happen inside the commands, so `--help` and
bad flags stay fast.
"""

from __future__ import annotations

import sys

from preempt.cli.parser import build_parser
from preempt.core.config import ConfigError
from preempt.core.workload import TraceError

__all__ = ["build_parser", "main"]


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
