"""`python -m preempt.server`: kept for existing scripts; the server lives in `preempt.serve`."""

from __future__ import annotations

import sys

from preempt.serve import (
    EngineLoop,
    PreemptServer,
    add_serve_arguments,
    cmd_serve,
    config_from_args,
    create_app,
    main,
    serve,
)

__all__ = [
    "EngineLoop",
    "PreemptServer",
    "add_serve_arguments",
    "cmd_serve",
    "config_from_args",
    "create_app",
    "main",
    "serve",
]

if __name__ == "__main__":
    sys.exit(main())
