"""The tiny model's checkpoint file (`lm.pt`, written by `preempt lm train`).

Owns: `save_tiny_lm` / `load_tiny_lm` and the file layout, a plain dict readable with
`torch.load(..., weights_only=True)` (no pickled classes, so loading runs no code):

    {"format": "preempt-tiny-lm", "version": 1,
     "config": {TinyConfig fields},   # dataclasses.asdict
     "state_dict": {name: float32 tensor},
     "meta": {...}}                   # JSON-like: training config, corpus, metrics

Weights are stored float32 whatever the training dtype; the loader casts to the dtype
asked for. It never imports the trainer (Lightning): the engine loads checkpoints on its
start-up path. Every problem is a ValueError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from preempt.model.tiny import TinyConfig, TinyLM

FORMAT = "preempt-tiny-lm"
VERSION = 1


def save_tiny_lm(model: TinyLM, path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Write `model` (any dtype) with float32 weights and `meta` (JSON-serialisable: the
    loader reads with weights_only=True; TypeError otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", torch.float32).clone() for name, t in model.state_dict().items()}
    blob = {
        "format": FORMAT,
        "version": VERSION,
        "config": dataclasses.asdict(model.cfg),
        "state_dict": state,
        # Through JSON: plain str/number/list/dict only (a str subclass such as
        # torch.__version__ would make weights_only loading refuse the file).
        "meta": json.loads(json.dumps(meta or {})),
    }
    # Write then rename: a reader (or the cache check of `preempt lm train`) never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)


def read_tiny_lm(path: str | Path) -> dict[str, Any]:
    """The validated checkpoint dict (format, version, config, state_dict, meta)."""
    path = Path(path)
    where = f"tiny LM checkpoint {path}"
    if not path.is_file():
        raise ValueError(f"{where}: file not found")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and weights_only errors have many types
        raise ValueError(f"{where}: not a readable torch checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        found = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"{where}: format is {found!r}, expected {FORMAT!r}")
    if blob.get("version") != VERSION:
        raise ValueError(f"{where}: version is {blob.get('version')!r}, this reader knows {VERSION}")
    for key, kind in (("config", dict), ("state_dict", dict), ("meta", dict)):
        if not isinstance(blob.get(key), kind):
            raise ValueError(f"{where}: missing or malformed {key!r}")
    return blob


def config_of(blob: dict[str, Any], where: str = "tiny LM checkpoint") -> TinyConfig:
    fields = {f.name for f in dataclasses.fields(TinyConfig)}
    unknown = sorted(set(blob["config"]) - fields)
    if unknown:
        raise ValueError(f"{where}: config has field(s) {unknown} this TinyConfig does not know")
    try:
        return TinyConfig(**blob["config"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: bad config: {err}") from None


def load_tiny_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> TinyLM:
    """The model in `path`, in eval mode, without gradients, in `dtype`."""
    blob = read_tiny_lm(path)
    where = f"tiny LM checkpoint {path}"
    model = TinyLM(config_of(blob, where), dtype=dtype, init_weights=False)  # every weight is loaded
    expected = model.state_dict()
    state = blob["state_dict"]
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where}: weights do not match its config: missing {missing}, unexpected {unexpected}"
        )
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.shape != expected[name].shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"{where}: weight {name} has shape {shape}, its config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()})
    model.requires_grad_(False)
    return model.eval()


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The `meta` dict of a checkpoint (validated like `load_tiny_lm`, weights not built)."""
    return read_tiny_lm(path)["meta"]
