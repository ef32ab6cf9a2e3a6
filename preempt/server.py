"""`python -m preempt.server`: kept for existing scripts; the server is `preempt.serve`."""

import sys

from preempt.serve import main

if __name__ == "__main__":
    sys.exit(main())
