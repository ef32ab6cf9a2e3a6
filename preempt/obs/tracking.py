"""Experiment tracking settings shared by every command that logs to wandb.

Owns: the `--wandb` modes and the default (online only when WANDB_API_KEY is set, else
offline: nothing may ever block on the network), and quieting Lightning's start-up chatter
for commands that print one JSON line, and `make_logger`, the Lightning trainers' one
seam to wandb (`preempt train`, `preempt lm train`). Imports neither wandb nor Lightning
at import time.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

WANDB_MODES = ("online", "offline", "disabled")
ONLINE_INIT_TIMEOUT_S = 15.0
"""How long an online wandb run may take to start before it falls back to offline."""


def resolve_wandb_mode(mode: str | None) -> str:
    """`--wandb` value -> the mode to use; None means the default."""
    if mode is None:
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode not in WANDB_MODES:
        raise ValueError(f"--wandb must be one of {', '.join(WANDB_MODES)}, got '{mode}'")
    return mode


def quiet_lightning() -> None:
    """Lightning's start-up banner (GPU/TPU availability, tips) and the num_workers advice
    would bury the one JSON line the CLI prints; the data is gathered in-process."""
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # Output folders hold wandb/ and metrics.json next to the checkpoints on purpose.
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")


def make_logger(mode: str | None, save_dir: Path, project: str, config: dict[str, Any]) -> Any:
    """The wandb seam: a WandbLogger writing under `save_dir/wandb`, or False (disabled).

    The run starts here, not at Lightning's first log call, so an online run that cannot
    reach the server within `ONLINE_INIT_TIMEOUT_S` falls back to offline (with a
    warning) instead of holding up training."""
    mode = resolve_wandb_mode(mode)
    if mode == "disabled":
        return False
    import wandb
    from pytorch_lightning.loggers import WandbLogger

    save_dir.mkdir(parents=True, exist_ok=True)
    # console="off": wandb must not wrap stdout, where the CLI prints its JSON; no system
    # stats sampler process for a run that lasts seconds.
    settings = dict(silent=True, console="off", x_disable_stats=True)

    def start(offline: bool) -> Any:
        logger = WandbLogger(
            project=project,
            save_dir=str(save_dir),
            offline=offline,
            config=config,
            log_model=False,
            settings=wandb.Settings(
                mode="offline" if offline else "online", init_timeout=ONLINE_INIT_TIMEOUT_S, **settings
            ),
        )
        logger.experiment  # noqa: B018 -- starts the run now (see docstring)
        return logger

    if mode == "offline":
        return start(offline=True)
    try:
        return start(offline=False)
    except Exception as err:  # wandb raises several types (CommError, UsageError, timeouts)
        warnings.warn(f"wandb online failed ({err}); logging offline under {save_dir}", stacklevel=2)
        return start(offline=True)
