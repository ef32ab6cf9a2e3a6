"""The plugin's settings: which preempt policy, its `preemption` section, the clock.

Read from vLLM's `--additional-config '{"preempt": {...}}'` (VllmConfig.additional_config)
or, failing that, from $PREEMPT_VLLM_CONFIG (inline JSON or the path of a JSON file). Frozen
and validated on construction; a bad value raises one error naming the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from preempt.core.config import PreemptionConfig, format_validation_error
from preempt.engine.policies import POLICIES

ENV_VAR = "PREEMPT_VLLM_CONFIG"
ADDITIONAL_CONFIG_KEY = "preempt"


class SettingsError(ValueError):
    """Plugin settings that cannot be used; the message names the field."""


class PluginSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = "priority_score"
    """A `scheduler.policy` of preempt (`preempt.engine.policies.POLICIES`)."""
    preemption: PreemptionConfig = PreemptionConfig()
    """preempt's `preemption` section: weights, threshold, slices, rate cap, fallback.
    vLLM drops a victim's KV and recomputes it, so `mode` must be `recompute`."""
    clock: Literal["wall", "steps"] = "wall"
    """`wall`: real time (time.monotonic), for serving. `steps`: every step lasts
    `step_ms`, so the same requests give the same decisions on any machine."""
    step_ms: float = Field(10.0, gt=0)
    """`steps` clock: the duration charged to each step (time slices, ages, rate cap)."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy '{value}'; choose one of {sorted(POLICIES)}")
        return value

    @field_validator("preemption")
    @classmethod
    def _recompute_only(cls, value: PreemptionConfig) -> PreemptionConfig:
        if value.mode != "recompute":
            raise ValueError(
                f"mode '{value.mode}': vLLM preempts by recompute; KV offloading is vLLM's "
                "kv_offloading_size, not a preempt mode"
            )
        return value


def parse_settings(data: object) -> PluginSettings:
    if data is None:
        return PluginSettings()
    if not isinstance(data, Mapping):
        raise SettingsError("preempt plugin settings must be a JSON object")
    try:
        return PluginSettings.model_validate(dict(data))
    except ValidationError as err:
        raise SettingsError(f"preempt plugin settings: {format_validation_error(err, 'field')}") from None


def load_settings(
    additional_config: object = None, environ: Mapping[str, str] | None = None
) -> PluginSettings:
    """`additional_config["preempt"]` if present, else $PREEMPT_VLLM_CONFIG, else defaults."""
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        return parse_settings(additional_config[ADDITIONAL_CONFIG_KEY])
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
    if not raw:
        return PluginSettings()
    text = raw if raw.startswith("{") else _read(raw)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SettingsError(f"${ENV_VAR} is not valid JSON: {err}") from None
    return parse_settings(data)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as err:
        raise SettingsError(f"${ENV_VAR}: cannot read {path}: {err.strerror}") from None
