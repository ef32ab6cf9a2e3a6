"""Inputs a sweep point derives from its config: a slower copy link, longer prompts.

Owns: the grid keys under `derive.` and the files they write under `OUT/inputs/`, which
the point's engine config then names (the engine has no knob for either):

- `derive.link_gb_s: X`: the point's `clock.target` with its host<->device copy link at X
  GB/s one way (both ways scaled by the same factor), written as a full target profile
  (`preempt/core/profiles.py` format). PCIe Gen5 x16 is the built-in 50 GB/s; Gen4 x16 ~25;
  a link shared by N GPUs (or by N tenants' copies) ~50/N.
- `derive.prompt_scale: X`: the point's `workload.trace` with every prompt X times longer
  (rounded, at least 1 token), arrivals and output lengths unchanged, as a Mooncake-format
  JSONL. Long-context regimes on real arrival patterns.
- `derive.slice_scale: X`: every time slice (the static one, the dynamic long / medium /
  short ones and the minimum) X times the point's, so a sweep moves slice lengths past
  a step's time (~10-50 ms on the virtual H200) without listing five keys.
- `derive.sla_mix: "70-20-10"`: the SLA mix as percentages of levels 0, 1, 2, ... (a
  readable point label and a run directory name, where a dict would be neither); they must
  sum to 100.

The last two only change the config; the first two write files.

Must never: write outside `OUT/inputs/`, or change a file it wrote for other contents (a
file is rewritten only when its contents differ, so reruns and `--resume` see the same
paths).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from preempt.core.config import ConfigError

DERIVED_PREFIX = "derive."
DERIVED_KEYS = ("derive.link_gb_s", "derive.prompt_scale", "derive.slice_scale", "derive.sla_mix")
SLICE_KEYS = ("static_ms", "long_ms", "medium_ms", "short_ms")


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"grid key '{key}': expected a number > 0, got {value!r}")
    return float(value)


def _tag(x: float) -> str:
    return f"{x:g}".replace(".", "p")


def link_target(target: str, gb_s: float, inputs: Path) -> str:
    """A profile file: `target` with its copy link at `gb_s` GB/s one way."""
    from preempt.core.profiles import get_target

    base = get_target(target)
    device = base.device.to_dict()
    factor = gb_s * 1e9 / device["copy_one_way_bytes_per_s"]
    device["copy_one_way_bytes_per_s"] = gb_s * 1e9
    device["copy_both_ways_bytes_per_s"] *= factor
    device["sources"] = {
        **device.get("sources", {}),
        "copy_one_way_bytes_per_s": f"sweep: derive.link_gb_s={gb_s:g} (experiments/derive.py)",
        "copy_both_ways_bytes_per_s": f"sweep: {base.name}'s both-ways rate x {factor:.4g}",
    }
    name = f"{base.name}-link{_tag(gb_s)}"
    profile = {
        "name": name,
        "model": dataclasses.asdict(base.model),
        "num_gpus": base.num_gpus,
        "device": device,
        "gpu_mem_util": base.gpu_mem_util,
        "activation_reserve_bytes": base.activation_reserve_bytes,
    }
    return _write(inputs / f"target-{name}.json", json.dumps(profile, indent=1, sort_keys=True) + "\n")


def scaled_trace(trace: str, scale: float, inputs: Path) -> str:
    """A JSONL trace: `trace` with prompts `scale` times longer."""
    from preempt.core.workload import load_trace, resolve_trace

    rows = load_trace(trace)
    lines = [
        json.dumps(
            {
                "timestamp": row.arrival_s * 1000.0,
                "input_length": max(1, round(row.prompt_tokens * scale)),
                "output_length": row.output_tokens,
            }
        )
        for row in rows
    ]
    stem = Path(resolve_trace(trace)).stem
    return _write(inputs / f"trace-{stem}-prompt{_tag(scale)}.jsonl", "\n".join(lines) + "\n")


def apply_derived(data: dict[str, Any], key: str, value: Any, out_dir: Path) -> None:
    """Write the input `key=value` derives from the engine config dict `data` and point
    `data` at it. Raises ConfigError naming the key."""
    inputs = out_dir / "inputs"
    if key == "derive.link_gb_s":
        clock = data.setdefault("clock", {})
        target = clock.get("target", "h200-llama3-8b")
        try:
            clock["target"] = link_target(target, _number(key, value), inputs)
        except ValueError as err:  # an unknown or malformed target
            raise ConfigError(f"grid key '{key}': {err}") from None
    elif key == "derive.prompt_scale":
        workload = data.setdefault("workload", {})
        try:
            workload["trace"] = scaled_trace(workload.get("trace", "azure-conv"), _number(key, value), inputs)
        except ValueError as err:  # TraceError: unknown or malformed trace
            raise ConfigError(f"grid key '{key}': {err}") from None
    elif key == "derive.slice_scale":
        from preempt.core.config import PreemptionConfig, TimeSliceConfig

        scale = _number(key, value)
        preemption = data.setdefault("preemption", {})
        slices = preemption.setdefault("time_slices", {})
        for name in SLICE_KEYS:
            slices[name] = float(slices.get(name, TimeSliceConfig.model_fields[name].default)) * scale
        minimum = preemption.get(
            "min_time_slice_ms", PreemptionConfig.model_fields["min_time_slice_ms"].default
        )
        preemption["min_time_slice_ms"] = float(minimum) * scale
    elif key == "derive.sla_mix":
        data.setdefault("workload", {})["sla_mix"] = sla_mix(key, value)
    else:
        raise ConfigError(f"unknown grid key '{key}'; derived keys: {', '.join(DERIVED_KEYS)}")


def sla_mix(key: str, value: Any) -> dict[int, float]:
    """ "70-20-10" -> {0: 0.7, 1: 0.2, 2: 0.1}."""
    try:
        shares = [float(part) for part in str(value).split("-")]
    except ValueError:
        raise ConfigError(
            f"grid key '{key}': expected percentages like \"70-20-10\", got {value!r}"
        ) from None
    if any(x < 0 for x in shares) or abs(sum(shares) - 100.0) > 1e-6:
        raise ConfigError(f"grid key '{key}': percentages must be >= 0 and sum to 100, got {value!r}")
    return {level: share / 100.0 for level, share in enumerate(shares)}
