"""The profiles the virtual clock is computed from: model shapes, device constants, targets.

Owns: the Llama-family model shapes (`MODELS`, from each model's config.json), the
per-GPU device constants (`DeviceProfile`: fitted to measured operator times, each with
its source, loaded from `preempt/profiles/*.json` and validated field by field, a bad one
raising `ProfileError` that names it) and the deployment targets (`TargetProfile`: a model
on `num_gpus` GPUs of one kind; the built-in `TARGETS`, or a profile file). Plain Python,
no torch, no numpy. The formula that turns a step into seconds is
`preempt.core.cost_model`'s.

KV capacity follows vLLM: total device memory x gpu_memory_utilization, less weights and
an activation reserve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

GB = 1e9
MiB = 2**20

PROFILE_DIR = "profiles"  # inside the preempt package


class ProfileError(ValueError):
    """A malformed or incomplete profile file; the message names the field."""


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
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")


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
        """Validate a parsed profile; a missing or bad field raises ProfileError naming it."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected an object of device constants")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "sources":
                continue
            if f.name == "op_tables":
                values[f.name] = _op_tables(data.get(f.name, {}), f"{where}.op_tables")
                continue
            if f.name not in data:
                raise ProfileError(f"{where}: missing field '{f.name}'")
            raw = data[f.name]
            key = f"{where}.{f.name}"
            if f.name == "name":
                if not isinstance(raw, str) or not raw:
                    raise ProfileError(f"{key}: expected a non-empty string")
                values[f.name] = raw
            elif f.name == "elementwise":
                values[f.name] = {
                    op: _elementwise(_get(raw, op, key), f"{key}.{op}") for op in ELEMENTWISE_OPS + ("emb",)
                }
            elif f.name == "all_reduce":
                if not isinstance(raw, dict) or not raw:
                    raise ProfileError(f"{key}: expected an object {{num_gpus: [latency_s, bytes_per_s]}}")
                values[f.name] = {
                    _int_key(n, key): _pair(v, f"{key}.{n}", allow_zero_floor=True) for n, v in raw.items()
                }
            else:
                zero_ok = f.name in (
                    "copy_latency_s",
                    "linear_floor_s",
                    "attn_floor_s",
                    "attn_per_row_head_s",
                    "attn_masked_share",
                    "cpu_step_overhead_s",
                )
                values[f.name] = _number(raw, key, allow_zero=zero_ok)
                if f.name == "attn_masked_share" and values[f.name] > 1:
                    raise ProfileError(f"{key}: a share, expected 0..1, got {raw!r}")
        sources = data.get("sources", {})
        if not isinstance(sources, dict):
            raise ProfileError(f"{where}.sources: expected an object field -> source")
        return cls(**values, sources={str(k): str(v) for k, v in sources.items()})


def _get(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ProfileError(f"{where}: expected an object")
    if key not in obj:
        raise ProfileError(f"{where}: missing field '{key}'")
    return obj[key]


def _number(raw: Any, key: str, allow_zero: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ProfileError(f"{key}: expected a number, got {raw!r}")
    if raw < 0 or (raw == 0 and not allow_zero):
        raise ProfileError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {raw!r}")
    return float(raw)


def _pair(raw: Any, key: str, allow_zero_floor: bool) -> tuple[float, float]:
    if not isinstance(raw, list | tuple) or len(raw) != 2:
        raise ProfileError(f"{key}: expected [floor_s, bytes_per_s]")
    return _number(raw[0], key, allow_zero=allow_zero_floor), _number(raw[1], key)


def _elementwise(raw: Any, key: str) -> tuple[float, float, float, float]:
    if not isinstance(raw, list | tuple) or len(raw) != 4:
        raise ProfileError(
            f"{key}: expected [floor_s, bytes_per_s, row_s_per_byte, exponent] "
            f"(a profile from before the row term has two numbers: refit it), got {raw!r}"
        )
    floor, rate, row = _number(raw[0], key, True), _number(raw[1], key), _number(raw[2], key, True)
    exponent = _number(raw[3], key)
    if exponent < 1:
        raise ProfileError(f"{key}: exponent must be >= 1, got {exponent!r}")
    return floor, rate, row, exponent


TABLE_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", *ELEMENTWISE_OPS, "emb")


def _op_tables(raw: Any, where: str) -> dict[str, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]]:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected an object {{'model/tpN': {{op: [tokens, seconds]}}}}")
    out: dict[str, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]] = {}
    for key, ops in raw.items():
        model, _, tp = str(key).partition("/tp")
        if not model or not tp.isdigit() or int(tp) < 1:
            raise ProfileError(f"{where}: key {key!r}: expected 'model/tpN', e.g. 'llama3-8b/tp1'")
        if not isinstance(ops, dict):
            raise ProfileError(f"{where}.{key}: expected an object op -> [tokens, seconds]")
        out[str(key)] = {}
        for op, pair in ops.items():
            at = f"{where}.{key}.{op}"
            if op not in TABLE_OPS:
                raise ProfileError(f"{at}: unknown operator; tables take {list(TABLE_OPS)}")
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ProfileError(f"{at}: expected [token counts, seconds]")
            tokens, seconds = pair
            if not isinstance(tokens, list | tuple) or not isinstance(seconds, list | tuple):
                raise ProfileError(f"{at}: expected [token counts, seconds]")
            if len(tokens) != len(seconds) or len(tokens) < 2:
                raise ProfileError(f"{at}: token counts and seconds differ in length or have < 2 points")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens) or any(
                b <= a for a, b in zip(tokens, tokens[1:], strict=False)
            ):
                raise ProfileError(f"{at}: token counts must be positive integers, strictly ascending")
            out[str(key)][op] = (tuple(tokens), tuple(_number(x, at) for x in seconds))
    return out


def _int_key(raw: Any, where: str) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: key {raw!r} is not a GPU count") from None
    if n < 2:
        raise ProfileError(f"{where}: key {raw!r}: all-reduces need 2+ GPUs")
    return n


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
    for key in ("model", "num_gpus", "device"):
        if key not in data:
            raise ProfileError(f"{path.name}: missing field '{key}'")
    model = data["model"]
    if isinstance(model, str):
        if model not in MODELS:
            raise ProfileError(f"{path.name}: model: unknown '{model}'; choose one of {sorted(MODELS)}")
        shape = MODELS[model]
    elif isinstance(model, dict):
        try:
            shape = ModelShape(**model)
        except TypeError as err:
            raise ProfileError(f"{path.name}: model: {err}") from None
    else:
        raise ProfileError(f"{path.name}: model: expected a name or an object")
    num_gpus = data["num_gpus"]
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ProfileError(f"{path.name}: num_gpus: expected a positive integer, got {num_gpus!r}")
    device = data["device"]
    device = (
        load_device(device)
        if isinstance(device, str)
        else DeviceProfile.from_dict(device, where=f"{path.name}: device")
    )
    if num_gpus > 1 and num_gpus not in device.all_reduce:
        raise ProfileError(f"{path.name}: device.all_reduce has no entry for {num_gpus} GPUs")
    extra = {
        k: _number(data[k], f"{path.name}: {k}")
        for k in ("gpu_mem_util", "activation_reserve_bytes")
        if k in data
    }
    return TargetProfile(str(data.get("name", path.stem)), shape, num_gpus, device, **extra)


# name -> (model, number of GPUs, bundled device profile)
_BUILTIN = {
    "h200-llama3-8b": ("llama3-8b", 1, "h200"),
    "4xh200-llama3-70b": ("llama3-70b", 4, "h200"),
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
