"""The plugin's settings: which preempt policy, its `preemption` section, the clock.

Read from vLLM's `--additional-config '{"preempt": {...}}'` (VllmConfig.additional_config)
or, failing that, from $PREEMPT_VLLM_CONFIG (inline JSON or the path of a JSON file). Frozen
and validated on construction; a bad value raises one error naming the field.

The plugin's defaults (`PLUGIN_DEFAULTS`) differ from preempt's engine defaults in three
named choices, all so that the most urgent class is never worse off than under vLLM's
own `--scheduling-policy priority` on a real server's wall clock:
- `preemption.rate_cap_counts: priority`: only priority preemptions fill the 30-a-minute
  cap. vLLM's forced memory preemptions are not the plugin's to refuse; counted, a burst
  of them (96 in 25 s in the run docs/vllm_plugin.md reports) spent the whole budget and
  left the urgent class unable to displace anyone.
- `preemption.priority_weights: {age: 0.05, age_cap_s: 15}`: age orders requests within an
  SLA level (and breaks ties toward the oldest) but can add at most 0.75 to a score, less
  than one SLA level (0.8). The design's 1.2/s outranks a level in 0.7 s: on a wall clock
  with seconds-long requests that is first-come order, and priority 0 queued behind any
  priority-3 request 2 s older.
- `preemption.backoff.counts: priority`: only a failed priority preemption starts the
  admission backoff. vLLM's forced preemptions still mark a request PREEMPTION_FAILED when
  they reach `max_consecutive_preemptions` (it is then a victim of last resort), but no
  longer hold new admissions: counted, under steady memory pressure (`preempt bench vllm
  --http --shape priority`: 60 priority-3 requests of 200 tokens in 24 blocks) they marked
  a request every ~2.7 s, under the backoff's 10 s reset, so its delay sat at the 2 s cap;
  the urgent class, never run and so held, was refused admission in 5526 of the 5554
  steps it led the queue (5462 of them with blocks and a seat free), and its mean TTFT
  was 0.61-0.69 s against vLLM priority's ~0.1-0.3 s.
User settings are laid over these key by key (a nested section merges, it does not
replace), so `{"preemption": {"threshold": 0.3}}` keeps the other defaults; set
`"age_cap_s": null`, `"rate_cap_counts": "all"` or `"backoff": {"counts": "all"}` to return
to the engine's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from preempt.core.config import PreemptionConfig, format_validation_error
from preempt.core.registry import SCHEDULING_POLICIES

ModelT = TypeVar("ModelT", bound=BaseModel)

PLUGIN_CLS = "preempt.integrations.vllm.scheduler.PreemptScheduler"
"""What `--scheduler-cls` names (a string: vLLM imports the class itself)."""
ASYNC_PLUGIN_CLS = "preempt.integrations.vllm.scheduler.PreemptAsyncScheduler"
"""The same policy on vLLM's `AsyncScheduler`: what the general plugin (plugin.py) puts in
the config, for either name, wherever vLLM chose async scheduling."""
ENV_VAR = "PREEMPT_VLLM_CONFIG"
ADDITIONAL_CONFIG_KEY = "preempt"


PLUGIN_DEFAULTS: dict = {
    "preemption": {
        "rate_cap_counts": "priority",
        "priority_weights": {"age": 0.05, "age_cap_s": 15.0},
        "backoff": {"counts": "priority"},
    }
}


class SettingsError(ValueError):
    """Plugin settings that cannot be used; the message names the field."""


class PluginSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = "priority_score"
    """A `scheduler.policy` of preempt (`preempt.core.registry.SCHEDULING_POLICIES`, or
    the import path of a user's own policy)."""
    preemption: PreemptionConfig = PreemptionConfig()
    """preempt's `preemption` section: weights, threshold, slices, rate cap, fallback.
    vLLM drops a victim's KV and recomputes it, so `mode` must be `recompute`. Read
    through `parse_settings`, which lays it over `PLUGIN_DEFAULTS`."""
    clock: Literal["wall", "steps"] = "wall"
    """`wall`: real time (time.monotonic), for serving. `steps`: every step lasts
    `step_ms`, so the same requests give the same decisions on any machine."""
    step_ms: float = Field(10.0, gt=0)
    """`steps` clock: the duration charged to each step (time slices, ages, rate cap)."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return SCHEDULING_POLICIES.check(value)

    @field_validator("preemption")
    @classmethod
    def _recompute_only(cls, value: PreemptionConfig) -> PreemptionConfig:
        if value.mode != "recompute":
            raise ValueError(
                f"mode '{value.mode}': vLLM preempts by recompute; KV offloading is vLLM's "
                "kv_offloading_size, not a preempt mode"
            )
        if value.remaining == "oracle":
            raise ValueError("remaining 'oracle': a server does not know a request's true output length")
        if value.remaining == "learned" and value.length_model is None:
            raise ValueError(
                "remaining 'learned' needs length_model (a `preempt lengths` file): "
                "the plugin has no trace to fit one from"
            )
        return value


def _merged(defaults: Mapping, given: Mapping) -> dict:
    out = dict(defaults)
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def validate_settings(
    model: type[ModelT], data: object, error: type[ValueError], where: str, defaults: Mapping | None = None
) -> ModelT:
    """`data` (a user's JSON object, None for none) laid over `defaults`, as `model`; a
    bad value raises `error` whose message names the field (`where` says whose)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise error(f"{where} must be a JSON object")
    try:
        return model.model_validate(_merged(defaults or {}, data))
    except ValidationError as err:
        raise error(f"{where}: {format_validation_error(err, 'field', model)}") from None


def parse_settings(data: object) -> PluginSettings:
    """`data` (the user's settings, None for none) laid over `PLUGIN_DEFAULTS`."""
    return validate_settings(PluginSettings, data, SettingsError, "preempt plugin settings", PLUGIN_DEFAULTS)


def load_settings(
    additional_config: object = None, environ: Mapping[str, str] | None = None
) -> PluginSettings:
    """`additional_config["preempt"]` if present, else $PREEMPT_VLLM_CONFIG, else defaults."""
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        return parse_settings(additional_config[ADDITIONAL_CONFIG_KEY])
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
    if not raw:
        return parse_settings(None)
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
