"""Registries: the one home of each kind of plug-in's names.

A registry maps a name (what a config says: `scheduler.policy: priority_score`) to the
import path of its class (`module:Class`). Config validation reads the names without
importing the class (`check`); the engine imports a class when it builds one (`resolve`).

The ground floor names no module above it: every layer adds its own names when its
package is imported (`Registry.add`, in `preempt/kv/__init__.py`, `preempt/engine/__init__.py`,
`preempt/early/__init__.py`: strings only, nothing heavy), and the package root imports
those packages, so any `import preempt...` sees every built-in name. A user's own class
lives in the user's own file and is used without editing preempt, in either of two ways:

- an import path as the name, as vLLM's `--scheduler-cls` takes one:
  `scheduler.policy: my_policies:ShortestFirst` (`module:Class`, or `module.Class`);
- `REGISTRY.register("shortest_first")` as a class decorator, in a module imported before
  the config is validated.

Beside the KV codecs' registry (`CODECS`) live the names that choose a codec:
`PREEMPTION_MODES` (each `preemption.mode` and the codec its preemptions save with) and
`RECLAIM_CODECS` (what `preemption.reclaim_codec` may name), read by config validation,
the scheduler and the saver alike.

Plain Python: no torch, nothing imported until asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """Names of one kind (`kind`: the config key they are chosen by, or what they are when
    no one key chooses them; `noun`: what its errors call one, the config error names the
    key) -> import paths."""

    def __init__(self, kind: str, noun: str, entries: dict[str, str | None] | None = None) -> None:
        self.kind = kind
        self.noun = noun
        self._paths: dict[str, str | None] = dict(entries or {})  # None: a name that builds nothing
        self._classes: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._paths)

    def add(self, name: str, path: str | None) -> None:
        """Name the class at `path` (`module:Class`, imported when first built; None: a name
        that builds nothing). How a package registers its own names without importing them."""
        if self._paths.get(name, path) != path:
            raise ValueError(f"{self.kind}: {self.noun} '{name}' is already registered")
        self._paths[name] = path

    def register(self, name: str) -> Callable[[type], type]:
        """A class decorator: `@SCHEDULING_POLICIES.register("mine")`."""

        def add(cls: type) -> type:
            if name in self._paths and self._classes.get(name) is not cls:
                raise ValueError(f"{self.kind}: {self.noun} '{name}' is already registered")
            self._paths[name] = f"{cls.__module__}:{cls.__qualname__}"
            self._classes[name] = cls
            return cls

        return add

    def check(self, name: str) -> str:
        """`name` if it is registered or an import path that resolves; else ValueError
        naming the choices (what a config validator raises)."""
        if name not in self._paths:  # registered names import only when built
            self.resolve(name)
        return name

    def resolve(self, name: str) -> Any:
        """The class of `name` (imported now), or None for a name that builds nothing."""
        if name in self._classes:
            return self._classes[name]
        path = self._paths[name] if name in self._paths else name
        if path is None:
            return None
        if not _is_path(path):
            raise ValueError(
                f"unknown {self.noun} '{name}'; choose one of {sorted(self._paths)} "
                "or give an import path (module:Class)"
            )
        module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{self.noun} '{name}': cannot import {module_name}: {exc}") from None
        try:
            cls = getattr(module, attr)
        except AttributeError:
            raise ValueError(f"{self.noun} '{name}': {module_name} has no {attr}") from None
        self._classes[name] = cls
        return cls


def _is_path(name: str) -> bool:
    return ":" in name or "." in name


SCHEDULING_POLICIES = Registry("scheduler.policy", "policy")
"""`scheduler.policy`: whom to admit and whom to preempt (the engine's policies)."""

EARLY_SAVE_POLICIES = Registry("early_save.policy", "early-save policy")
"""`early_save.policy`: whom to copy to the host before a preemption."""

# No config key of its own: `early_save.policy` and `early_save.prefetch` turn them on.
STEP_HOOKS = Registry("step hook", "step hook")
"""What the engine calls with its view after each step, built from the `early_save` config:
the engine reaches the layer above it only through these names."""

# No config key of its own: `preemption.mode` and `reclaim_codec` choose one.
CODECS = Registry("kv codec", "codec")
"""KV codecs: how a saved request's KV becomes a host blob and back (preempt.kv.codec's
`CODECS` and `make_codec` read this). A new codec adds its name beside the others, or
registers with `@CODECS.register("name")`, with a `codec_id` no other codec uses."""

PREEMPTION_MODES: dict[str, str | None] = {
    "recompute": None,
    "swap": "raw",
    "swap_zstd": "zstd",
    "swap_mixed": "mixed",
    "pause": None,
}
"""`preemption.mode` -> the codec (a name of `CODECS`) its preemptions save the victim's KV
with. None: a preemption saves nothing -- `recompute` drops the KV, `pause` keeps it
resident and saves it with `preemption.reclaim_codec` when its blocks are reclaimed (or
a preemption forced by memory must free them). Beside these, `swap_<name>` is a mode for
every codec `<name>` in `CODECS` (`swap_fp8`, `swap_lz4`): a new codec needs no line here."""

SWAP_PREFIX = "swap_"

RECLAIM_CODECS = ("raw", "zstd")
"""`preemption.reclaim_codec`: the codecs of `CODECS` that can save a paused request (the
lossless ones that need no head plan)."""


def mode_codec(mode: str) -> str | None:
    """The codec `mode` saves with (`PREEMPTION_MODES`, or `<name>` of `swap_<name>`);
    KeyError if `mode` is none of them."""
    if mode in PREEMPTION_MODES:
        return PREEMPTION_MODES[mode]
    name = mode.removeprefix(SWAP_PREFIX)
    if mode.startswith(SWAP_PREFIX) and name in CODECS.names():
        return name
    raise KeyError(mode)


def check_mode(mode: str) -> str:
    """`mode` if it is a `preemption.mode`; else ValueError naming the choices."""
    try:
        mode_codec(mode)
    except KeyError:
        raise ValueError(
            f"unknown preemption mode '{mode}'; choose one of {list(PREEMPTION_MODES)} "
            f"or swap_<codec> for a codec of {CODECS.names()}"
        ) from None
    return mode


def check_reclaim_codec(name: str) -> str:
    """`name` if it is a `RECLAIM_CODECS` codec; else ValueError naming the choices."""
    if name not in RECLAIM_CODECS:
        what = "cannot save a paused request" if name in CODECS.names() else "is not a registered codec"
        raise ValueError(f"codec '{name}' {what}; choose one of {list(RECLAIM_CODECS)}")
    return name


def save_codec(mode: str, reclaim_codec: str) -> str:
    """The codec a save under `mode` uses: the mode's own (`mode_codec`), else (a `pause`
    reclaim, or its forced or early save) `reclaim_codec`."""
    return mode_codec(mode) or reclaim_codec
