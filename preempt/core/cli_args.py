"""The argument parser of every command line here (`preempt`, `python -m preempt.serve`).

Owns: the one rule they share: a bad flag ends with one line on stderr naming it, and
exit code 2 (argparse's usage block would bury it). Below the CLI and the server both, so
neither imports the other for it.
"""

from __future__ import annotations

import argparse


class ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


class LeafParser(ArgParser):
    """A subcommand's parser that refuses a flag it does not take itself, naming the
    subcommand (`preempt bench engine: error: unrecognized arguments: --vidur`); argparse
    would leave it to the top parser, which cannot say whose flag it is not."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def positive_int(text: str) -> int:
    """An argparse type: an integer above 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value
