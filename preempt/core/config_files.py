"""Config files: reading a JSON or YAML file (a relative path not found where it is given
is looked up among the bundled configs, preempt/configs/), `--set a.b=value` overrides,
and `load_config`, which validates the result into an `EngineConfig`
(preempt.core.config: the sections, their fields and their checks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from preempt.core.config import ConfigError, EngineConfig, build_config

BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The configs that ship with the package (preempt/configs/: the engine's, the serving
example, every ablation's): a relative config path that is not found where it is given is
looked up here, so `--config engine_quick.yaml` works from any directory."""


def find_config_file(path: str | Path, beside: str | Path | None = None) -> Path:
    """Where the config file `path` is: as given (relative to the cwd; or, given `beside`,
    relative to that directory, as an ablation's `base_config` is to its file), else, for a
    relative path, among the bundled configs (BUNDLED_CONFIGS). Raises ConfigError listing
    every place it looked."""
    path = Path(path)
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [path if beside is None else Path(beside) / path, BUNDLED_CONFIGS / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = " and ".join(str(candidate.absolute()) for candidate in candidates)
    raise ConfigError(f"config file not found: {path} (looked for {looked})")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict (no validation yet); a relative path missing from
    the cwd is looked up among the bundled configs (`find_config_file`)."""
    path = find_config_file(path)
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {err}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value), the value parsed as YAML (so 10, 0.5, true, null and
    {0: 1.0} keep their types; what YAML cannot parse stays a string)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    key, raw = assignment.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `data["a"]["b"]["c"] = value` for key "a.b.c" in place, creating sections."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"empty key in '{key}'")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `--set a.b.c=value` override in place (`parse_assignment`, `set_dotted`)."""
    key, value = parse_assignment(assignment)
    try:
        set_dotted(data, key, value)
    except ConfigError as err:
        raise ConfigError(f"--set {assignment}: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> EngineConfig:
    """Config file (optional) + `--set` overrides -> validated EngineConfig."""
    data = read_config_file(path) if path is not None else {}
    for assignment in overrides:
        apply_override(data, assignment)
    return build_config(data)
