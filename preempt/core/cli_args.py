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
