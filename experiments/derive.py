"""Inputs a sweep point derives from its config: a slower copy link, longer prompts.

Owns: the grid keys under `derive.` and the files they write under `OUT/inputs/`, which
the point's engine config then names (the engine has no knob for either):

- `derive.link_gb_s: X`: the point's `clock.target` with its host<->device copy link at X
  GB/s one way (both ways scaled by the same factor), written as a full target profile
  (`preempt/core/cost_model.py` format). PCIe Gen5 x16 is the built-in 50 GB/s; Gen4 x16 ~25;
  a link shared by N GPUs (or by N tenants' copies) ~50/N.
- `derive.prompt_scale: X`: the point's `workload.trace` with every prompt X times longer
  (rounded, at least 1 token), arrivals and output lengths unchanged, as a Mooncake-format
  JSONL. Long-context regimes on real arrival patterns.

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
DERIVED_KEYS = ("derive.link_gb_s", "derive.prompt_scale")


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
    from preempt.core.cost_model import get_target

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
    else:
        raise ConfigError(f"unknown grid key '{key}'; derived keys: {', '.join(DERIVED_KEYS)}")
