"""Step durations, copy times and KV capacity of a deployment target, for the virtual clock.

Owns: the model shapes (Llama family), the per-GPU device constants (fitted to measured
operator times, each with its source, loaded from `preempt/profiles/*.json`) and the
operator-level formula that turns a step's shape into seconds. Plain Python, no torch,
no numpy. It never runs anything: the tiny model on a laptop computes real tokens while
this says how long an H200 serving Llama-3-8B would have taken for the same step.

One step, per GPU (tensor parallelism shards heads and the MLP over `num_gpus`):
    step_s = cpu_step_overhead_s + emb(T)
             + num_layers * (linears(T) + elementwise(T) + attention + all_reduces(T))
             + lm_head(num_seqs)
    linear(M, K, N)  = floor + smoothmax(2MKN / flops_per_s, 2(KN + MK + MN) / bytes_per_s; p)
    smoothmax(a, b; p) = (a^p + b^p)^(1/p)       (p -> inf is the sharp roofline max)
    elementwise op   = smoothmax(floor + row_bytes * row_s_per_byte, bytes / bytes_per_s; p)
                       (RMSNorm x2, RoPE, SiLU*mul, add; per op; row_bytes: one token's)
    attention        = floor + per_row_head_s * q_heads * (num_tokens - num_seqs)
                       + smoothmax(KV bytes read / kv_bytes_per_s,
                                   4 * q_heads * head_dim * (sum_attn_ctx + masked_share * sum_masked_ctx)
                                   / flops_per_s; p)
    all_reduce(n)    = latency(tp) + n / bytes_per_s(tp), twice a layer (after O and down)
The LM head runs only for sampled positions (one per scheduled sequence), as engines do.
Where the device profile holds measured times of an operator for the target's model and
GPU count (`op_tables`, as Vidur predicts from its profiles), that operator costs its
formula time x (measured / formula), interpolated in log(tokens) between measured counts.
Copies to and from the host share one duplex link: `one_way` bytes/s when one direction
is busy, `both_ways` bytes/s in total when both are, plus a per-copy latency.
KV capacity follows vLLM: total device memory x gpu_memory_utilization, less weights and
an activation reserve.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

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


# ------------------------------------------------------------------------------ step
class StepShape(NamedTuple):
    """What a step computes, in the units the cost model needs."""

    num_tokens: int  # new tokens in the batch (prefill chunks + decodes)
    sum_attn_ctx: int  # sum over new tokens of the context each attends to
    sum_kv_read: int  # KV tokens read: each scheduled sequence's context once
    # Sequences in the step = positions whose logits are computed. None: unknown, every
    # token is charged (an upper bound; the engine always says).
    num_seqs: int | None = None
    # Key-query pairs causal masking removes inside the chunks (n(n-1)/2 for a chunk of n
    # new tokens), charged at the device's attn_masked_share; 0 when the caller does not say.
    sum_masked_ctx: int = 0


def step_shape(chunks: Iterable[tuple[int, int]]) -> StepShape:
    """The shape of a step that runs `chunks`: (tokens computed before, new tokens) per
    scheduled sequence."""
    num_tokens = sum_attn_ctx = sum_kv_read = sum_masked_ctx = num_seqs = 0
    for start, num_new in chunks:
        end = start + num_new
        num_tokens += num_new
        # token at position p attends to p+1 keys: sum_{p=start}^{end-1} (p+1)
        sum_attn_ctx += (start + 1 + end) * num_new // 2
        sum_kv_read += end
        # the pairs causal masking removes inside the chunk (a kernel may still compute them)
        sum_masked_ctx += num_new * (num_new - 1) // 2
        num_seqs += 1
    return StepShape(num_tokens, sum_attn_ctx, sum_kv_read, num_seqs, sum_masked_ctx)


def smooth_max(a: float, b: float, p: float) -> float:
    """(a^p + b^p)^(1/p): the roofline max, rounded near the knee where neither term
    alone explains the measured time (p fitted)."""
    hi = max(a, b)
    if hi <= 0.0:
        return 0.0
    return hi * ((a / hi) ** p + (b / hi) ** p) ** (1.0 / p)


class OpTimes(NamedTuple):
    """One step's seconds by operator kind (whole model, per GPU; they sum to the step)."""

    linear: float
    elementwise: float
    attention: float
    all_reduce: float
    lm_head: float
    cpu: float

    @property
    def total(self) -> float:
        return sum(self)


class CostModel:
    def __init__(self, target: TargetProfile) -> None:
        self.target = target
        m, tp, dev = target.model, target.num_gpus, target.device
        self._tp = tp
        self._dev = dev
        h = m.hidden_size
        # (K, N) of each per-layer GEMM on one GPU: column-parallel QKV and up, row-parallel O and down
        mlp_out = (2 if m.is_gated_mlp else 1) * m.intermediate_size
        self._layer_gemms = (
            ("attn_pre_proj", h, (m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim // tp),
            ("attn_post_proj", m.num_q_heads * m.head_dim // tp, h),
            ("mlp_up_proj", h, mlp_out // tp),
            ("mlp_down_proj", m.intermediate_size // tp, h),
        )
        b = m.dtype_bytes
        # bytes each elementwise kernel moves per token (read + write) on one GPU
        self._elementwise_bytes = {
            "input_layernorm": 2 * h * b,
            "post_attention_layernorm": 2 * h * b,
            "attn_rope": 2 * (m.num_q_heads + m.num_kv_heads) * m.head_dim // tp * b,
            "mlp_act": (mlp_out + m.intermediate_size) // tp * b if m.is_gated_mlp else 2 * mlp_out // tp * b,
            "add": 3 * h * b,
        }
        self._q_heads = m.num_q_heads // tp
        self._attn_flops_per_ctx = 4 * self._q_heads * m.head_dim
        self._kv_bytes_per_ctx = m.kv_bytes_per_token // m.num_layers // tp
        self._allreduce_bytes_per_token = h * b
        if tp > 1 and tp not in dev.all_reduce:
            raise ProfileError(f"device {dev.name}: no all-reduce latencies for {tp} GPUs")
        self.table_key = f"{m.name}/tp{tp}"
        # op -> (log token counts, log(measured / analytic)) at the measured counts
        self._corrections: dict[str, tuple[list[float], list[float]]] = {}
        for op, (tokens, seconds) in dev.op_tables.get(self.table_key, {}).items():
            analytic = [self._analytic_s(op, t) for t in tokens]
            self._corrections[op] = (
                [math.log(t) for t in tokens],
                [math.log(sec / a) for sec, a in zip(seconds, analytic, strict=True)],
            )
        # The step's terms that depend on its token count alone (the GEMMs, elementwise
        # kernels and all-reduces: ten roofline terms, each with its powers) and the
        # lm_head's, on its sequence count alone, computed once per count: a replay's
        # steps repeat the same few thousand counts (`max_num_batched_tokens` bounds
        # them; the azure-conv hour has 1,819 over 479k steps).
        self._token_terms: dict[int, tuple[float, float, float]] = {}
        self._lm_head: dict[int, float] = {}

    @property
    def measured_ops(self) -> tuple[str, ...]:
        """The operators this target charges from measured tables (none: all analytic)."""
        return tuple(self._corrections)

    def _correction(self, op: str, num_tokens: int) -> float:
        table = self._corrections.get(op)
        if table is None or num_tokens < 1:
            return 1.0
        xs, ys = table
        x = math.log(num_tokens)
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return math.exp(ys[0])
        if i == len(xs):
            return math.exp(ys[-1])
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1]))

    def _analytic_s(self, op: str, num_tokens: int) -> float:
        for name, k, n in self._layer_gemms:
            if name == op:
                return self.linear_s(num_tokens, k, n)
        return self._elementwise_analytic_s(op, num_tokens)

    # ------------------------------------------------------------ operators
    def linear_s(self, num_tokens: int, k: int, n: int) -> float:
        d = self._dev
        flops_s = 2.0 * num_tokens * k * n / d.linear_flops_per_s
        bytes_s = 2.0 * (k * n + num_tokens * k + num_tokens * n) / d.linear_bytes_per_s
        return d.linear_floor_s + smooth_max(flops_s, bytes_s, d.linear_exponent)

    def elementwise_s(self, op: str, num_tokens: int) -> float:
        return self._elementwise_analytic_s(op, num_tokens) * self._correction(op, num_tokens)

    def _elementwise_analytic_s(self, op: str, num_tokens: int) -> float:
        floor, rate, row_s_per_byte, exponent = self._dev.elementwise[op]
        per_token = self._elementwise_bytes[op] if op != "emb" else 2 * self._allreduce_bytes_per_token
        return smooth_max(floor + per_token * row_s_per_byte, num_tokens * per_token / rate, exponent)

    def attention_s(
        self, sum_attn_ctx: int, sum_kv_read: int, prefill_rows: int = 0, sum_masked_ctx: int = 0
    ) -> float:
        """One layer's attention on one GPU (decode reads KV; prefill is FLOP-bound):
        `prefill_rows` new tokens beyond each sequence's first, `sum_masked_ctx` causally
        masked pairs inside chunks."""
        d = self._dev
        kv_s = sum_kv_read * self._kv_bytes_per_ctx / d.attn_kv_bytes_per_s
        pairs = sum_attn_ctx + d.attn_masked_share * sum_masked_ctx
        flops_s = pairs * self._attn_flops_per_ctx / d.attn_flops_per_s
        return (
            d.attn_floor_s
            + d.attn_per_row_head_s * self._q_heads * prefill_rows
            + smooth_max(kv_s, flops_s, d.attn_exponent)
        )

    def all_reduce_s(self, num_bytes: float) -> float:
        if self._tp == 1:
            return 0.0
        latency, rate = self._dev.all_reduce[self._tp]
        return latency + num_bytes / rate

    def layer_linear_s(self, num_tokens: int) -> dict[str, float]:
        return {
            op: self.linear_s(num_tokens, k, n) * self._correction(op, num_tokens)
            for op, k, n in self._layer_gemms
        }

    def op_times(self, shape: StepShape) -> OpTimes:
        t = shape.num_tokens
        num_layers = self.target.model.num_layers
        seqs = t if shape.num_seqs is None else min(shape.num_seqs, t)
        terms = self._token_terms.get(t)
        if terms is None:
            terms = self._token_terms[t] = self._token_count_terms(t)
        linear, elementwise, all_reduce = terms
        # prefill rows: new tokens beyond each sequence's first (none if num_seqs is unknown)
        attention = num_layers * self.attention_s(
            shape.sum_attn_ctx, shape.sum_kv_read, t - seqs, shape.sum_masked_ctx
        )
        lm_head = self._lm_head.get(seqs)
        if lm_head is None:
            lm_head = self._lm_head[seqs] = self._lm_head_s(seqs)
        return OpTimes(linear, elementwise, attention, all_reduce, lm_head, self._dev.cpu_step_overhead_s)

    def _token_count_terms(self, t: int) -> tuple[float, float, float]:
        """(linear, elementwise, all_reduce) seconds of a step of `t` tokens."""
        num_layers = self.target.model.num_layers
        linear = num_layers * sum(self.layer_linear_s(t).values())
        elementwise = num_layers * sum(self.elementwise_s(op, t) for op in ELEMENTWISE_OPS)
        elementwise += self.elementwise_s("emb", t)
        all_reduce = num_layers * 2 * self.all_reduce_s(t * self._allreduce_bytes_per_token)
        return linear, elementwise, all_reduce

    def _lm_head_s(self, seqs: int) -> float:
        m = self.target.model
        return self.linear_s(seqs, m.hidden_size, m.vocab_size // self._tp) if seqs else 0.0

    # ------------------------------------------------------------ public API
    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return self.op_times(shape).total

    def kv_capacity_blocks(self, block_size: int) -> int:
        return self.target.kv_capacity_tokens // block_size

    def copy_time_s(self, num_bytes: float, both_ways: bool = False) -> float:
        """Device<->host copy of a request's KV (all GPUs copy their shard at once) on the
        duplex link: `both_ways` when the other direction is busy at the same time."""
        d = self._dev
        rate = d.copy_both_ways_bytes_per_s / 2 if both_ways else d.copy_one_way_bytes_per_s
        return d.copy_latency_s + num_bytes / (self._tp * rate)

    def pcie_time_s(self, num_bytes: float) -> float:
        """A copy with the link's other direction idle (see copy_time_s)."""
        return self.copy_time_s(num_bytes)

    def hbm_pass_time_s(self, num_bytes: float) -> float:
        """A memory-bound kernel that reads and writes `num_bytes` in all (e.g. the save
        path's gather + quantize: raw in, packed out), at the fitted elementwise rate of
        the residual add (the plainest streaming kernel measured), shard per GPU."""
        floor, rate = self._dev.elementwise["add"][:2]
        return floor + num_bytes / (self._tp * rate)
