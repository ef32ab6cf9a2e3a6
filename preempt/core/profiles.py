"""The profiles the virtual clock is computed from: model shapes, device constants, targets.

Owns: the Llama-family model shapes (`MODELS`, from each model's config.json), the
per-GPU device constants (`DeviceProfile`: fitted to measured operator times, each with
its source, loaded from `preempt/profiles/*.json`) and the deployment targets
(`TargetProfile`: a model on `num_gpus` GPUs of one kind; the built-in `TARGETS`, or a
profile file). What a profile file may hold, and the `ProfileError` that names a bad
field, is `preempt.core.profile_schema`'s (pydantic). No torch, no numpy. The formula that
turns a step into seconds is `preempt.core.cost_model`'s.

KV capacity follows vLLM: total device memory x gpu_memory_utilization, less weights and
an activation reserve.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from preempt.core.profile_schema import (
    ELEMENTWISE_OPS,
    TABLE_OPS,
    DeviceFile,
    ProfileError,
    TargetFile,
    validate,
)

__all__ = [
    "ELEMENTWISE_OPS",
    "MODELS",
    "TABLE_OPS",
    "TARGETS",
    "DeviceProfile",
    "ModelShape",
    "ProfileError",
    "TargetProfile",
    "bundled_devices",
    "get_target",
    "load_device",
    "load_target",
]
GB = 1e9
MiB = 2**20

PROFILE_DIR = "profiles"  # inside the preempt package


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shape (from its config.json on the HF hub)."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    is_gated_mlp: bool = True
    dtype_bytes: int = 2  # bf16/fp16 weights and KV

    @cached_property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_q_heads + 2 * self.num_kv_heads) * d + self.num_q_heads * d * h
        mlp = (3 if self.is_gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp + 2 * h  # + the two RMSNorm weights

    @cached_property
    def num_params(self) -> int:
        """All parameters: layers, final norm, embedding and an untied LM head."""
        return self.num_layers * self.layer_params + self.hidden_size + 2 * self.vocab_size * self.hidden_size

    @cached_property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (whole model, all GPUs together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json -> 8.03B parameters
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    # meta-llama/Meta-Llama-3-70B config.json -> 70.6B parameters
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    # meta-llama/Llama-2-7b-hf and Llama-2-70b-hf config.json (the H100 profiles' models)
    "llama2-7b": ModelShape("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama2-70b": ModelShape("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
}


# ---------------------------------------------------------------------------- device
@dataclass(frozen=True)
class DeviceProfile:
    """One GPU kind's fitted constants. Every field has an entry in `sources`."""

    name: str
    linear_flops_per_s: float  # GEMM throughput the fit finds at large token counts
    linear_bytes_per_s: float  # GEMM weight-streaming rate at small token counts
    linear_exponent: float  # smooth-max exponent p (sharp roofline: p -> inf)
    linear_floor_s: float  # per-GEMM fixed cost (launch, tail of the last wave)
    # op -> (floor_s, bytes_per_s, row_s_per_byte, exponent): a small launch is flat at its
    # floor, plus the time one block takes through one token's row (the kernels give each
    # token a block: wide rows cost before the GPU fills), until streaming dominates
    elementwise: dict[str, tuple[float, float, float, float]]
    attn_kv_bytes_per_s: float  # decode: KV bytes read per second
    attn_flops_per_s: float  # prefill: attention FLOP/s
    attn_exponent: float
    attn_floor_s: float  # per layer, per step (the ~15-20 us a tiny attention call costs)
    # Per query head on the GPU and new token beyond each sequence's first (a prefill
    # chunk's rows; a decode has none): the rows' own work apart from the key-query pairs
    # (Q in, the softmax normalisation, O out; and small chunks fill fewer SMs).
    attn_per_row_head_s: float
    # Share of the causally masked key-query pairs inside a chunk that the kernel still
    # computes (1: no masked-tile skipping, the profiled kernel; 0: all skipped).
    attn_masked_share: float
    all_reduce: dict[int, tuple[float, float]]  # num GPUs -> (latency_s, bytes_per_s)
    cpu_step_overhead_s: float  # scheduler + input prep + sampling on the host, per step
    copy_one_way_bytes_per_s: float  # pinned device<->host, one direction busy
    copy_both_ways_bytes_per_s: float  # both directions busy: the two together
    copy_latency_s: float  # per copy (small blocks are latency-bound)
    mem_total_bytes: float  # what the device reports as its total memory
    # Measured operator times, as Vidur's profiles are used: "model/tpN" -> op -> (token
    # counts ascending, seconds). Optional; a target of that model and GPU count then
    # charges each tabled op its analytic time x (measured / analytic), the ratio
    # interpolated in log(tokens) between measured counts and held at the ends, so the
    # fitted formula carries the shape between and beyond the measurements.
    op_tables: dict[str, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]] = field(
        default_factory=dict, compare=False
    )
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["elementwise"] = {op: list(v) for op, v in self.elementwise.items()}
        out["all_reduce"] = {str(n): list(v) for n, v in self.all_reduce.items()}
        out["op_tables"] = {
            key: {op: [list(t), list(sec)] for op, (t, sec) in ops.items()}
            for key, ops in self.op_tables.items()
        }
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "device") -> DeviceProfile:
        """Validate a parsed profile (preempt.core.profile_schema's `DeviceFile`); a missing
        or bad field raises ProfileError naming it."""
        return cls(**validate(DeviceFile, data, where).fields())


def load_device(name_or_path: str | Path) -> DeviceProfile:
    """A bundled device profile by name (`h200`, `h100`, `a100`) or a profile file."""
    path = Path(name_or_path)
    if path.suffix == ".json":
        text = _read(path)
    else:
        bundled = resources.files("preempt").joinpath(PROFILE_DIR, f"{name_or_path}.json")
        if not bundled.is_file():
            raise ProfileError(
                f"unknown device profile '{name_or_path}'; bundled: {sorted(bundled_devices())}"
            )
        text = bundled.read_text()
        path = Path(str(bundled))
    data = _parse(text, path)
    return DeviceProfile.from_dict(data.get("device", data), where=f"{path.name}: device")


def bundled_devices() -> list[str]:
    folder = resources.files("preempt").joinpath(PROFILE_DIR)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise ProfileError(f"cannot read profile {path}: {err.strerror}") from None


def _parse(text: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path.name}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path.name}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------- target
@dataclass(frozen=True)
class TargetProfile:
    """A deployment: a model on `num_gpus` GPUs of one kind (tensor parallel)."""

    name: str
    model: ModelShape
    num_gpus: int
    device: DeviceProfile
    gpu_mem_util: float = 0.9  # vLLM's default gpu_memory_utilization
    # Per GPU: activations of the profiling run + CUDA graphs + non-torch memory. vLLM
    # measures it at start-up; 2 GB is the order it reports for an 8B model (assumption,
    # replaced by `preempt calibrate --device cuda`'s measured free memory).
    activation_reserve_bytes: float = 2 * GB

    # The old flat attributes, used by the saver and tests.
    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def sources(self) -> str:
        return f"{self.model.name}: HF config.json; device {self.device.name}: " + "; ".join(
            f"{k}: {v}" for k, v in sorted(self.device.sources.items())
        )

    @cached_property
    def kv_capacity_tokens(self) -> int:
        per_gpu = self.device.mem_total_bytes * self.gpu_mem_util - self.activation_reserve_bytes
        return int((self.num_gpus * per_gpu - self.weight_bytes) // self.kv_bytes_per_token)


def load_target(path: str | Path) -> TargetProfile:
    """A target from a profile file: either a full target
    `{"name", "model": name or shape, "num_gpus", "device": name or constants}` or a bare
    device profile (then Llama-3-8B on one GPU of it)."""
    path = Path(path)
    data = _parse(_read(path), path)
    if data.get("kind") == "device" or ("model" not in data and "device" not in data):
        device = DeviceProfile.from_dict(data.get("device", data), where=f"{path.name}: device")
        return TargetProfile(f"{path.stem}-llama3-8b", MODELS["llama3-8b"], 1, device)
    spec = validate(TargetFile, data, path.name)
    if isinstance(spec.model, str):
        if spec.model not in MODELS:
            raise ProfileError(f"{path.name}: model: unknown '{spec.model}'; choose one of {sorted(MODELS)}")
        shape = MODELS[spec.model]
    elif isinstance(spec.model, dict):
        try:
            shape = ModelShape(**spec.model)
        except TypeError as err:
            raise ProfileError(f"{path.name}: model: {err}") from None
    else:
        raise ProfileError(f"{path.name}: model: expected a name or an object")
    device = (
        load_device(spec.device)
        if isinstance(spec.device, str)
        else DeviceProfile.from_dict(spec.device, where=f"{path.name}: device")
    )
    if spec.num_gpus > 1 and spec.num_gpus not in device.all_reduce:
        raise ProfileError(f"{path.name}: device.all_reduce has no entry for {spec.num_gpus} GPUs")
    extra = {
        k: getattr(spec, k)
        for k in ("gpu_mem_util", "activation_reserve_bytes")
        if getattr(spec, k) is not None
    }
    return TargetProfile(spec.name or path.stem, shape, spec.num_gpus, device, **extra)


# name -> (model, number of GPUs, bundled device profile)
_BUILTIN = {
    "h200-llama3-8b": ("llama3-8b", 1, "h200"),
    "4xh200-llama3-70b": ("llama3-70b", 4, "h200"),
    # the deployment `preempt bench peers --vidur` compares on: Vidur's own profiles
    # cover it with measured data (benchmarks/vidur/README.md)
    "2xa100-llama3-70b": ("llama3-70b", 2, "a100"),
}


class _Targets(Mapping[str, TargetProfile]):
    """The built-in targets, their profiles read on first use (not at import: the
    calibration that writes them imports this module)."""

    def __init__(self) -> None:
        self._loaded: dict[str, TargetProfile] = {}

    def __getitem__(self, name: str) -> TargetProfile:
        if name not in self._loaded:
            model, num_gpus, device = _BUILTIN[name]  # KeyError: not a built-in
            self._loaded[name] = TargetProfile(name, MODELS[model], num_gpus, load_device(device))
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_BUILTIN)

    def __len__(self) -> int:
        return len(_BUILTIN)


TARGETS: Mapping[str, TargetProfile] = _Targets()


def get_target(name: str) -> TargetProfile:
    """A built-in target by name, or a profile file (`*.json`)."""
    if name.endswith(".json"):
        return load_target(name)
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown clock.target '{name}'; choose one of {sorted(TARGETS)} or a profile .json file"
        ) from None
