"""Experiment tracking settings shared by every command that logs to wandb.

Owns: the `--wandb` modes and the default (online only when WANDB_API_KEY is set, else
offline: nothing may ever block on the network), and quieting Lightning's start-up chatter
for commands that print one JSON line. Imports neither wandb nor Lightning.
"""

from __future__ import annotations

import logging
import os
import warnings

WANDB_MODES = ("online", "offline", "disabled")


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
