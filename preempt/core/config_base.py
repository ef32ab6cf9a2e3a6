"""What every config section shares: `ConfigError` (a message that names the key), the
frozen `Section` base, and the one wording of a validation error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __deepcopy__(self, memo: dict[int, object] | None = None) -> Section:
        return self  # frozen: a copy of the engine shares its config, as a tuple would


def format_validation_error(err: ValidationError, noun: str = "config key") -> str:
    """pydantic's first error as one line naming the dotted key: "unknown <noun> 'a.b'" or
    "<noun> 'a.b': <message>". Every pydantic-validated input of the project (engine
    config, ablation files, parity workloads, the vLLM plugin's settings) words its errors
    this way; `noun` is what the input calls its keys."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    if first["type"] == "extra_forbidden":
        return f"unknown {noun} '{key}'"
    return f"{noun} '{key}': {first['msg']}"
