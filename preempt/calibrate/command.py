"""What `preempt calibrate` does: fit Vidur's profiles, fit a measurement file, or
measure this GPU; writes device profiles (`{"kind": "device", "device": {...}}`) that
`clock.target` reads (a bare device profile means Llama-3-8B on one such GPU)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from preempt.core.profiles import DeviceProfile, ProfileError, load_device


def write_profile(path: Path, device: DeviceProfile, **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"kind": "device", "device": device.to_dict(), **extra}, indent=1)
    # a list of plain numbers on one line: the op tables are thousands of them
    text = re.sub(
        r"\[\s*([-+0-9.eE]+(?:,\s*[-+0-9.eE]+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m[1]) + "]", text
    )
    path.write_text(text + "\n")


def calibrate_vidur(out_dir: Path) -> list[Path]:
    from preempt.calibrate.fit import fit_vidur

    paths = []
    for name, device in fit_vidur().items():
        write_profile(out_dir / f"{name}.json", device)
        paths.append(out_dir / f"{name}.json")
    return paths


def calibrate_vllm_steps(logs: list[Path], out: Path) -> Path:
    """A target profile fitted to a real vLLM's step logs (preempt.calibrate.vllm_steps)."""
    from preempt.calibrate.vllm_steps import calibrate_vllm

    profile = calibrate_vllm(logs, name=out.stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]
    print(f"fitted on {fit['steps']} steps: RMS log error {fit['rms_log']}, predicted / measured "
          f"sum {fit['sum_ratio']}; use it with --set clock.target={out}", file=sys.stderr)  # fmt: skip
    return out


def calibrate_file(measurements: Path, out: Path, base: str) -> Path:
    from preempt.calibrate.fit import fit_measurements

    try:
        data = json.loads(measurements.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"cannot read measurements {measurements}: {err}") from None
    data = data.get("measurements", data)
    for key in ("device", "dtype", "shape", "linear", "lm_head", "elementwise", "attention", "copies"):
        if key not in data:
            raise ProfileError(f"{measurements.name}: missing field '{key}'")
    write_profile(out, fit_measurements(data, load_device(base), name=out.stem), measurements=data)
    return out


def calibrate_device(device: str, tiny: bool, out: Path, base: str) -> Path:
    import torch

    from preempt.calibrate.gpu import measure

    if device == "cuda" and not torch.cuda.is_available():
        if not tiny:
            raise ProfileError("--device cuda: no CUDA device here (add --tiny to run the code path on CPU)")
        print("preempt calibrate: no CUDA device; --tiny runs on CPU", file=sys.stderr)
        device = "cpu"
    log: list[str] = []

    def say(line: str) -> None:
        log.append(line)
        print(line, file=sys.stderr)

    data = measure(device, tiny=tiny, log=say)
    say(f"measured in {data['seconds']:.1f} s on {data['device']}")
    try:
        from preempt.calibrate.fit import fit_measurements
    except ImportError:  # a bare GPU box without numpy: keep the data, fit elsewhere
        out.write_text(json.dumps({"measurements": data, "log": log}, indent=1) + "\n")
        say(f"numpy missing: wrote measurements only; fit with `preempt calibrate --from {out}`")
        return out
    write_profile(out, fit_measurements(data, load_device(base), name=out.stem), measurements=data, log=log)
    return out
