"""What every config section shares: `ConfigError` (a message that names the key), the
frozen `Section` base, and the one wording of a validation error."""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __deepcopy__(self, memo: dict[int, object] | None = None) -> Section:
        return self  # frozen: a copy of the engine shares its config, as a tuple would


def format_validation_error(
    err: ValidationError, noun: str = "config key", model: type[BaseModel] | None = None
) -> str:
    """pydantic's first error as one line naming the dotted key: "unknown <noun> 'a.b'"
    (with "did you mean 'a.c'?" when `model`, the validated model, has a close one) or
    "<noun> 'a.b': <message>". Every pydantic-validated input of the project (engine
    config, ablation files, parity workloads, the vLLM plugin's settings) words its errors
    this way; `noun` is what the input calls its keys."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    key = ".".join(loc) or "<root>"
    if first["type"] == "extra_forbidden":
        near = _closest_key(model, loc) if model is not None and loc else None
        return f"unknown {noun} '{key}'" + (f" (did you mean '{near}'?)" if near else "")
    return f"{noun} '{key}': {first['msg']}"


def _closest_key(model: type[BaseModel], loc: list[str]) -> str | None:
    """The dotted key of `model` closest to the unknown `loc` (its parent's own keys only),
    or None when none is close or the parent is not a model."""
    section: object = model
    for part in loc[:-1]:
        fields = getattr(section, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *typing.get_args(annotation)]  # `X | None` too
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is None:
            return None
    names = list(getattr(section, "model_fields", {}))
    near = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    return ".".join([*loc[:-1], near[0]]) if near else None
