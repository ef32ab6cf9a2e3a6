"""`python -m preempt.cli`: the `preempt` command."""

import sys

from preempt.cli import main

if __name__ == "__main__":
    sys.exit(main())
