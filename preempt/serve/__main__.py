"""`python -m preempt.serve`: the same as `preempt serve`."""

import sys

from preempt.serve.args import main

sys.exit(main())
