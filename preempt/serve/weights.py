"""Which weights `preempt serve` serves, and the startup line that says so.

Owns: the default checkpoint (the reference LM that `make run` trains, when it exists under
the working directory and the user chose no model of their own) and the line that names
the weights at startup: the checkpoint's path, or a WARNING for weights that are not
trained, saying how to get trained ones.

It never loads weights: the engine does, from `model.checkpoint`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from preempt.core.config import ModelConfig

MODEL_CHOICES = ("backend", "checkpoint", "preset")
"""The `model` keys that choose a model: a user who sets any of them (in the config file,
with --set or with --model) gets exactly that, never the reference LM in its place."""


def reference_lm_path() -> Path:
    """The trained reference LM's file, relative to the working directory (where `make run`
    writes it)."""
    from preempt.lm.train import DEFAULT_LM_DIR, LM_FILE  # torch: only once a server is configured

    return DEFAULT_LM_DIR / LM_FILE


def default_to_reference_lm(data: dict[str, Any]) -> None:
    """Set `model.checkpoint` in the raw config `data` (in place) to the reference LM when
    its file exists and `data` names none of MODEL_CHOICES."""
    model = data.get("model")
    if model is not None and (not isinstance(model, dict) or model.keys() & set(MODEL_CHOICES)):
        return  # the user's choice (or a malformed section, which validation reports)
    path = reference_lm_path()
    if path.is_file():
        data.setdefault("model", {})["checkpoint"] = str(path)


def weights_line(model: ModelConfig, seed: int) -> tuple[int, str]:
    """(logging level, message) naming the weights a server of `model` serves."""
    if model.backend == "null":
        what = "NO MODEL (model.backend null): every token is a placeholder, not text"
        flags = "--set model.backend=tiny --set model.checkpoint=PATH"
    elif model.checkpoint:
        kind = "a Hugging Face checkpoint" if model.backend == "hf" else "a preempt lm train checkpoint"
        return logging.INFO, f"serving trained weights: {model.checkpoint} ({kind})"
    else:
        what = f"RANDOM weights (preset {model.preset}, seed {seed}): answers are random bytes, not text"
        flags = "--set model.checkpoint=PATH"
    return logging.WARNING, (
        f"serving {what}. For the trained reference LM, run 'make run' (it writes "
        f"{reference_lm_path()}, which preempt serve started in the same directory serves), "
        f"or pass {flags}"
    )
