"""What a profile file may hold, validated by pydantic: a device's fitted constants and a
deployment target's fields.

Owns: the schema of `preempt/profiles/*.json` and of user profile files (`DeviceFile`,
`TargetFile`), the operator names they use (`ELEMENTWISE_OPS`, `TABLE_OPS`) and
`ProfileError`, whose message names the file and the field
("h200.json: device.elementwise.add: expected [floor_s, ...]"). Fields a reader does not
know are ignored (profiles carry notes and fit logs). The objects the clock computes with
(`DeviceProfile`, `TargetProfile`) and the loading are `preempt.core.profiles`'.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, create_model


class ProfileError(ValueError):
    """A malformed or incomplete profile file; the message names the field."""


ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
TABLE_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", *ELEMENTWISE_OPS, "emb")


# ------------------------------------------------------------------ field types
def _finite(raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ValueError(f"expected a number, got {raw!r}")
    return float(raw)


def _positive(x: float) -> float:
    if x <= 0:
        raise ValueError(f"must be > 0, got {x!r}")
    return x


def _non_negative(x: float) -> float:
    if x < 0:
        raise ValueError(f"must be >= 0, got {x!r}")
    return x


def _share(x: float) -> float:
    if x > 1:
        raise ValueError(f"a share, expected 0..1, got {x!r}")
    return x


def _exponent(x: float) -> float:
    if x < 1:
        raise ValueError(f"exponent must be >= 1, got {x!r}")
    return x


Positive = Annotated[float, BeforeValidator(_finite), AfterValidator(_positive)]
NonNegative = Annotated[float, BeforeValidator(_finite), AfterValidator(_non_negative)]
Share = Annotated[NonNegative, AfterValidator(_share)]
Exponent = Annotated[Positive, AfterValidator(_exponent)]


def _sequence_of(size: int, shape: str) -> BeforeValidator:
    def check(raw: Any) -> Any:
        if not isinstance(raw, list | tuple) or len(raw) != size:
            raise ValueError(f"expected {shape}, got {raw!r}")
        return tuple(raw)

    return BeforeValidator(check)


def _non_empty_name(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError("expected a non-empty string")
    return raw


Name = Annotated[str, BeforeValidator(_non_empty_name)]
# floor_s, bytes_per_s, row_s_per_byte, exponent: flat at the floor for a small launch, plus
# one block's time through a token's row, until streaming dominates (preempt.core.cost_model)
ElementwiseFit = Annotated[
    tuple[NonNegative, Positive, NonNegative, Exponent],
    _sequence_of(
        4,
        "[floor_s, bytes_per_s, row_s_per_byte, exponent] "
        "(a profile from before the row term has two numbers: refit it)",
    ),
]
LatencyRate = Annotated[tuple[NonNegative, Positive], _sequence_of(2, "[latency_s, bytes_per_s]")]


def _gpu_count(raw: Any) -> int:
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise ValueError("not a GPU count") from None
    if n < 2:
        raise ValueError("all-reduces need 2+ GPUs")
    return n


def _object_of(shape: str, non_empty: bool = False) -> BeforeValidator:
    def check(raw: Any) -> Any:
        if not isinstance(raw, dict) or (non_empty and not raw):
            raise ValueError(f"expected an object {shape}")
        return raw

    return BeforeValidator(check)


def _table_key(raw: Any) -> str:
    model, _, tp = str(raw).partition("/tp")
    if not model or not tp.isdigit() or int(tp) < 1:
        raise ValueError("expected 'model/tpN', e.g. 'llama3-8b/tp1'")
    return str(raw)


def _table_op(raw: Any) -> str:
    if raw not in TABLE_OPS:
        raise ValueError(f"unknown operator; tables take {list(TABLE_OPS)}")
    return raw


def _table(raw: Any) -> Any:
    """[token counts ascending, seconds]: the shape and the counts (seconds: `Positive`)."""
    if not isinstance(raw, list | tuple) or len(raw) != 2:
        raise ValueError("expected [token counts, seconds]")
    tokens, seconds = raw
    if not isinstance(tokens, list | tuple) or not isinstance(seconds, list | tuple):
        raise ValueError("expected [token counts, seconds]")
    if len(tokens) != len(seconds) or len(tokens) < 2:
        raise ValueError("token counts and seconds differ in length or have < 2 points")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens) or any(
        b <= a for a, b in zip(tokens, tokens[1:], strict=False)
    ):
        raise ValueError("token counts must be positive integers, strictly ascending")
    return tuple(tokens), tuple(seconds)


OpTable = Annotated[tuple[tuple[int, ...], tuple[Positive, ...]], BeforeValidator(_table)]
OpTables = dict[
    Annotated[str, BeforeValidator(_table_key)],
    dict[Annotated[str, BeforeValidator(_table_op)], OpTable],
]


def _sources(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ValueError("expected an object field -> source")
    return {str(k): str(v) for k, v in raw.items()}


class _File(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


# Every elementwise operator has a fit, the embedding lookup included.
Elementwise = create_model(  # type: ignore[call-overload]
    "Elementwise",
    __base__=_File,
    **{op: (ElementwiseFit, ...) for op in (*ELEMENTWISE_OPS, "emb")},
)


class DeviceFile(_File):
    """One GPU kind's fitted constants (the meaning of each: `DeviceProfile`)."""

    name: Name
    linear_flops_per_s: Positive
    linear_bytes_per_s: Positive
    linear_exponent: Positive
    linear_floor_s: NonNegative
    elementwise: Elementwise  # type: ignore[valid-type]
    attn_kv_bytes_per_s: Positive
    attn_flops_per_s: Positive
    attn_exponent: Positive
    attn_floor_s: NonNegative
    attn_per_row_head_s: NonNegative
    attn_masked_share: Share
    all_reduce: Annotated[
        dict[Annotated[int, BeforeValidator(_gpu_count)], LatencyRate],
        _object_of("{num_gpus: [latency_s, bytes_per_s]}", non_empty=True),
    ]
    cpu_step_overhead_s: NonNegative
    copy_one_way_bytes_per_s: Positive
    copy_both_ways_bytes_per_s: Positive
    copy_latency_s: NonNegative
    mem_total_bytes: Positive
    op_tables: Annotated[OpTables, _object_of("{'model/tpN': {op: [tokens, seconds]}}")] = {}
    sources: Annotated[dict[str, str], BeforeValidator(_sources)] = {}

    def fields(self) -> dict[str, Any]:
        """The constants as `DeviceProfile` takes them."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        out["elementwise"] = self.elementwise.model_dump()
        return out


def _positive_int(raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"expected a positive integer, got {raw!r}")
    return raw


class TargetFile(_File):
    """A deployment: `model` a name or a shape, `device` a bundled name or constants."""

    name: str | None = None
    model: Any
    num_gpus: Annotated[int, BeforeValidator(_positive_int)]
    device: Any
    gpu_mem_util: Positive | None = None
    activation_reserve_bytes: Positive | None = None


def validate(schema: type[BaseModel], data: Any, where: str) -> Any:
    """`data` validated by `schema`; the first problem as a ProfileError naming the field
    after `where` ("h200.json: device" -> "h200.json: device.name: ...", a file name
    alone -> "t.json: num_gpus: ...")."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected an object")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_first_error(err, where)) from None


def _first_error(err: ValidationError, where: str) -> str:
    first = err.errors()[0]
    path = [str(p) for p in first["loc"] if p != "[key]"]
    if first["type"] == "missing":
        *path, name = path
        message = f"missing field '{name}'"
    else:
        message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
    if path:
        where += (": " if where.endswith(".json") else ".") + ".".join(path)
    return f"{where}: {message}"
