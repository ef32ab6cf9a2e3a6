"""The head plan of the mixed-precision save: per layer, per KV head, one storage class.

Owns: `HeadClass` (FP16 / FP8 / DROP / FP8_TOKEN / KIVI4 / KIVI2), the frozen `HeadPlan`,
its constructors (uniform, seeded random by shares, from importance scores, from a JSON
plan file), its validation, its JSON round trip and the size it implies
(`bytes_per_token`, `stored_bytes`, `size_vs_fp16`). It never touches KV data: the
kernels (`quantize_heads`, `restore_blocks`) read the plan, and whoever scores heads
(gradient importance, restored-prefix sensitivity: preempt/lm/importance.py) writes one.

Classes:
- FP16: kept at the cache's own dtype, bit-exact. In deployment that is a 16-bit dtype
  (fp16/bf16); the tiny model may run float32/float64 and then the kept head keeps those
  bytes (the name follows the design, the size follows the cache: see `bytes_per_token`).
- FP8: float8 E4M3 with one float32 scale per (layer, K or V, head) = amax / 448.
- DROP: not stored; restored as zeros and reported, so attention masks the head for the
  rest of the request's life.
- FP8_TOKEN: float8 E4M3 with one float32 scale per (head, K or V, token) = amax over the
  token's D channels / 448 (preempt/kernels/fp8_token.py).
- KIVI4 / KIVI2 (and KIVI_K<k>V<v>: k-bit keys, v-bit values): integers as KIVI does
  (Liu et al. 2024, arXiv 2402.02750):
  keys per channel (min and scale per channel over groups of `group_size` tokens), values
  per token (per group of `group_size` channels), min and scale in float16; the first
  `num_sink` (attention sink) and the last `num_recent` tokens kept bit-exact at the cache
  dtype (preempt/kernels/kivi_ref.py). `group_size`, `num_sink`, `num_recent` are plan-wide.

Slot order: heads of one class are packed in (layer, head) row-major order; `slot_index`
gives each head's row in its class's packed tensor (see preempt/kernels/quantize_heads.py).

JSON plan file (version 2; version 1 files, which have no KIVI keys, still load):

    {"format": "preempt-head-plan", "version": 2, "num_layers": 2, "num_kv_heads": 2,
     "group_size": 32, "num_sink": 4, "num_recent": 32,
     "layers": [["fp16", "kivi4"], ["drop", "fp8_token"]], "source": "free text, optional"}

A plan that uses only fp16/fp8/drop with the default KIVI parameters is written as
version 1, so files (and blobs) of the old classes stay readable by older readers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

PLAN_FORMAT = "preempt-head-plan"
PLAN_VERSION = 2
PLAN_VERSIONS = (1, 2)
FP8_BYTES = 1
SCALE_BYTES = 4  # one float32 scale per FP8 head, for K and for V


class HeadClass(IntEnum):
    """A KV head's storage class. The int values are the kernels' codes: never renumber."""

    FP16 = 0
    FP8 = 1
    DROP = 2
    FP8_TOKEN = 3
    KIVI4 = 4
    KIVI2 = 5
    KIVI_K5V4 = 6  # KIVI layout, 5-bit keys and 4-bit values: keys cost most (docs/codec.md)
    KIVI_K6V4 = 7
    KIVI_K8V4 = 8
    KIVI_K5V3 = 9

    @property
    def label(self) -> str:
        return self.name.lower()


_BY_LABEL = {cls.label: cls for cls in HeadClass}
LEGACY_CLASSES = (HeadClass.FP16, HeadClass.FP8, HeadClass.DROP)  # what version 1 knows
# Classes whose heads are packed into one uint8 row each (`QuantizedKV.extra`), in this order.
EXTRA_CLASSES = tuple(HeadClass)[3:]
KIVI_BITS = {  # (key bits, value bits)
    HeadClass.KIVI4: (4, 4),
    HeadClass.KIVI2: (2, 2),
    HeadClass.KIVI_K5V4: (5, 4),
    HeadClass.KIVI_K6V4: (6, 4),
    HeadClass.KIVI_K8V4: (8, 4),
    HeadClass.KIVI_K5V3: (5, 3),
}
DEFAULT_GROUP_SIZE = 32
DEFAULT_NUM_SINK = 4
DEFAULT_NUM_RECENT = 32
_PARAM_KEYS = ("group_size", "num_sink", "num_recent")
_KEYS = {"format", "version", "num_layers", "num_kv_heads", "layers", "source", *_PARAM_KEYS}


@dataclass(frozen=True)
class HeadPlan:
    """Per layer, per KV head: FP16, FP8 or DROP. Frozen and hashable (kernels cache the
    device copy of its index tables by plan)."""

    classes: tuple[tuple[HeadClass, ...], ...]  # [layer][kv_head]
    source: str = ""  # where the plan came from (free text, kept in the JSON file)
    group_size: int = DEFAULT_GROUP_SIZE  # KIVI: tokens per key group, channels per value group
    num_sink: int = DEFAULT_NUM_SINK  # KIVI: first tokens kept at full precision
    num_recent: int = DEFAULT_NUM_RECENT  # KIVI: last tokens kept at full precision

    def __post_init__(self) -> None:
        for name in _PARAM_KEYS:
            value = getattr(self, name)
            low = 1 if name == "group_size" else 0
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**31:
                raise ValueError(f"head plan {name} must be an integer in [{low}, 2^31), got {value!r}")
        if not isinstance(self.classes, tuple) or not self.classes:
            raise ValueError("a head plan needs at least one layer (a non-empty tuple of tuples)")
        width = len(self.classes[0]) if isinstance(self.classes[0], tuple) else -1
        for layer, row in enumerate(self.classes):
            if not isinstance(row, tuple):
                raise ValueError(f"layer {layer} of the head plan must be a tuple, got {type(row).__name__}")
            if len(row) != width or width == 0:
                raise ValueError(
                    f"layer {layer} has {len(row)} KV heads, layer 0 has {width}: a plan needs the same "
                    "number (> 0) of KV heads in every layer"
                )
            for head, cls in enumerate(row):
                if not isinstance(cls, HeadClass):
                    raise ValueError(f"layer {layer} head {head}: {cls!r} is not a HeadClass")

    # ---------------------------------------------------------------- shape and counts
    @property
    def num_layers(self) -> int:
        return len(self.classes)

    @property
    def num_kv_heads(self) -> int:
        return len(self.classes[0])

    def count(self, cls: HeadClass) -> int:
        return sum(row.count(cls) for row in self.classes)

    @property
    def num_fp16(self) -> int:
        return self.count(HeadClass.FP16)

    @property
    def num_fp8(self) -> int:
        return self.count(HeadClass.FP8)

    @property
    def num_drop(self) -> int:
        return self.count(HeadClass.DROP)

    @property
    def is_legacy(self) -> bool:
        """Only FP16/FP8/DROP and the default KIVI parameters: what version 1 files and
        blobs can say."""
        return all(c in LEGACY_CLASSES for row in self.classes for c in row) and self.params() == (
            DEFAULT_GROUP_SIZE,
            DEFAULT_NUM_SINK,
            DEFAULT_NUM_RECENT,
        )

    def params(self) -> tuple[int, int, int]:
        """(group_size, num_sink, num_recent)."""
        return (self.group_size, self.num_sink, self.num_recent)

    def with_classes(self, codes: np.ndarray, source: str) -> HeadPlan:
        """Another plan with these (L, H) codes and this plan's KIVI parameters."""
        return HeadPlan.from_codes(codes, source, params=self.params())

    def codes(self) -> np.ndarray:
        """(L, H) int8 class codes."""
        return np.array(self.classes, dtype=np.int8).reshape(self.num_layers, self.num_kv_heads)

    def slot_index(self) -> np.ndarray:
        """(L, H) int32: each head's row in its class's packed tensor ((layer, head)
        row-major within the class); -1 for dropped heads, which have no row."""
        codes = self.codes().reshape(-1)
        slots = np.full(codes.shape, -1, dtype=np.int32)
        for cls in HeadClass:
            if cls == HeadClass.DROP:
                continue
            where = np.flatnonzero(codes == cls)
            slots[where] = np.arange(where.size, dtype=np.int32)
        return slots.reshape(self.num_layers, self.num_kv_heads)

    def heads_of(self, cls: HeadClass) -> tuple[np.ndarray, np.ndarray]:
        """(layers, heads) index arrays of one class, in slot order."""
        return np.nonzero(self.codes() == cls)

    def dropped_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(L, H) bool, True where the head is dropped: what attention must mask."""
        return torch.as_tensor(self.codes() == HeadClass.DROP, device=device)

    def check_shape(self, num_layers: int, num_kv_heads: int) -> None:
        """Raise ValueError unless the plan fits a model of this shape."""
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise ValueError(
                f"head plan is for {self.num_layers} layers x {self.num_kv_heads} KV heads, "
                f"the KV cache has {num_layers} x {num_kv_heads}"
            )

    # ---------------------------------------------------------------- constructors
    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_class: HeadClass) -> HeadPlan:
        _check_dims(num_layers, num_kv_heads)
        return cls(tuple(tuple([HeadClass(head_class)] * num_kv_heads) for _ in range(num_layers)))

    @classmethod
    def all_fp16(cls, num_layers: int, num_kv_heads: int) -> HeadPlan:
        return cls.uniform(num_layers, num_kv_heads, HeadClass.FP16)

    @classmethod
    def all_fp8(cls, num_layers: int, num_kv_heads: int) -> HeadPlan:
        return cls.uniform(num_layers, num_kv_heads, HeadClass.FP8)

    @classmethod
    def from_codes(
        cls,
        codes: np.ndarray | Sequence[Sequence[int]],
        source: str = "",
        params: tuple[int, int, int] = (DEFAULT_GROUP_SIZE, DEFAULT_NUM_SINK, DEFAULT_NUM_RECENT),
    ) -> HeadPlan:
        """From an (L, H) array of class codes or a nested list of codes; `params` are
        (group_size, num_sink, num_recent)."""
        array = np.asarray(codes)
        if array.ndim != 2:
            raise ValueError(f"head plan codes must be 2-D (layers, kv_heads), got shape {array.shape}")
        bad = ~np.isin(array, [int(c) for c in HeadClass])
        if bad.any():
            layer, head = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"layer {layer} head {head}: unknown head class code {array[layer, head].item()!r}"
            )
        return cls(tuple(tuple(HeadClass(int(c)) for c in row) for row in array), source, *params)

    @classmethod
    def random(
        cls,
        num_layers: int,
        num_kv_heads: int,
        *,
        fp8_share: float,
        drop_share: float,
        seed: int,
    ) -> HeadPlan:
        """Exactly round(share * L * H) FP8 and DROP heads over the whole model, placed by a
        seeded permutation; the rest FP16. For ablations against importance-based plans."""
        _check_dims(num_layers, num_kv_heads)
        num_fp8, num_drop = _counts(num_layers * num_kv_heads, fp8_share, drop_share)
        codes = np.full(num_layers * num_kv_heads, int(HeadClass.FP16), dtype=np.int8)
        order = np.random.default_rng(seed).permutation(codes.size)
        codes[order[:num_drop]] = HeadClass.DROP
        codes[order[num_drop : num_drop + num_fp8]] = HeadClass.FP8
        source = f"random fp8_share={fp8_share} drop_share={drop_share} seed={seed}"
        return cls.from_codes(codes.reshape(num_layers, num_kv_heads), source)

    @classmethod
    def from_importance(
        cls, importance: np.ndarray | torch.Tensor, *, fp8_share: float, drop_share: float, source: str = ""
    ) -> HeadPlan:
        """(L, H) importance scores (e.g. Michel et al.'s E|dL/dxi|, normalised per layer,
        summed over each KV head's query heads) -> the least important `drop_share` of all
        heads DROP, the next `fp8_share` FP8, the rest FP16 (docs/design.md §9). Ties break by
        (layer, head) order, so equal scores give a deterministic plan."""
        scores = np.asarray(importance.cpu() if isinstance(importance, torch.Tensor) else importance, float)
        if scores.ndim != 2:
            raise ValueError(f"importance must be (layers, kv_heads), got shape {scores.shape}")
        _check_dims(*scores.shape)
        if not np.isfinite(scores).all():
            raise ValueError("importance scores must be finite")
        num_fp8, num_drop = _counts(scores.size, fp8_share, drop_share)
        order = np.argsort(scores.reshape(-1), kind="stable")  # least important first
        codes = np.full(scores.size, int(HeadClass.FP16), dtype=np.int8)
        codes[order[:num_drop]] = HeadClass.DROP
        codes[order[num_drop : num_drop + num_fp8]] = HeadClass.FP8
        return cls.from_codes(codes.reshape(scores.shape), source)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "version": 1 if self.is_legacy else PLAN_VERSION,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
        }
        if not self.is_legacy:
            data.update(zip(_PARAM_KEYS, self.params(), strict=True))
        data["layers"] = [[c.label for c in row] for row in self.classes]
        if self.source:
            data["source"] = self.source
        return data

    def to_json(self) -> str:
        # One layer per line: plan files are read and diffed by people.
        rows = ",\n    ".join(json.dumps(row) for row in self.to_dict()["layers"])
        head = {k: v for k, v in self.to_dict().items() if k != "layers"}
        return json.dumps(head)[:-1] + f', "layers": [\n    {rows}\n  ]}}\n'

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: Any, where: str = "head plan") -> HeadPlan:
        """Validate a parsed plan; any problem is a ValueError that names it."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        missing = sorted({"format", "version", "num_layers", "num_kv_heads", "layers"} - set(data))
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}")
        if data["format"] != PLAN_FORMAT:
            raise ValueError(f"{where}: 'format' is {data['format']!r}, expected {PLAN_FORMAT!r}")
        if data["version"] not in PLAN_VERSIONS:
            raise ValueError(f"{where}: 'version' is {data['version']!r}, this reader knows {PLAN_VERSIONS}")
        if data["version"] == 1 and set(_PARAM_KEYS) & set(data):
            raise ValueError(f"{where}: {list(_PARAM_KEYS)} need 'version' 2")
        params = []
        for key, default in zip(
            _PARAM_KEYS, (DEFAULT_GROUP_SIZE, DEFAULT_NUM_SINK, DEFAULT_NUM_RECENT), strict=True
        ):
            value = data.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < (key == "group_size"):
                raise ValueError(
                    f"{where}: {key!r} must be an integer >= {int(key == 'group_size')}, got {value!r}"
                )
            params.append(value)
        for key in ("num_layers", "num_kv_heads"):
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] <= 0:
                raise ValueError(f"{where}: {key!r} must be a positive integer, got {data[key]!r}")
        source = data.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"{where}: 'source' must be a string, got {type(source).__name__}")
        layers = data["layers"]
        if not isinstance(layers, list) or len(layers) != data["num_layers"]:
            count = len(layers) if isinstance(layers, list) else type(layers).__name__
            raise ValueError(f"{where}: 'layers' has {count} rows, 'num_layers' says {data['num_layers']}")
        rows = []
        for layer, row in enumerate(layers):
            if not isinstance(row, list) or len(row) != data["num_kv_heads"]:
                count = len(row) if isinstance(row, list) else type(row).__name__
                raise ValueError(
                    f"{where}: layer {layer} has {count} heads, 'num_kv_heads' says {data['num_kv_heads']}"
                )
            for head, label in enumerate(row):
                if data["version"] == 1 and label in _BY_LABEL and _BY_LABEL[label] not in LEGACY_CLASSES:
                    raise ValueError(f"{where}: layer {layer} head {head}: class {label!r} needs 'version' 2")
                if label not in _BY_LABEL:
                    raise ValueError(
                        f"{where}: layer {layer} head {head}: unknown class {label!r}; "
                        f"valid: {', '.join(_BY_LABEL)}"
                    )
            rows.append(tuple(_BY_LABEL[label] for label in row))
        return cls(tuple(rows), source, *params)

    @classmethod
    def from_json(cls, text: str, where: str = "head plan") -> HeadPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc}") from None
        return cls.from_dict(data, where)

    @classmethod
    def load(cls, path: str | Path) -> HeadPlan:
        """Read and validate a JSON plan file (ValueError naming the file and the problem)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"head plan file {path}: cannot read: {exc.strerror}") from None
        return cls.from_json(text, where=f"head plan file {path}")


def bytes_per_token(plan: HeadPlan, head_dim: int, dtype: torch.dtype) -> int:
    """Stored K+V bytes of one token over all layers under `plan`, for a cache of `dtype`:
    FP16 heads cost the cache's itemsize, FP8 heads 1 byte, dropped heads nothing. Excludes
    the per-request scales (`scale_bytes`), which do not grow with tokens. Only for plans of
    the per-token-constant classes (FP16/FP8/DROP): the others' cost depends on the length
    (`stored_bytes`)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be > 0, got {head_dim}")
    if any(plan.count(cls) for cls in EXTRA_CLASSES):
        raise ValueError(
            "bytes_per_token is for fp16/fp8/drop plans; use stored_bytes(plan, num_tokens, ...)"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * head_dim * (plan.num_fp16 * itemsize + plan.num_fp8 * FP8_BYTES)


class KiviLayout(NamedTuple):
    """Where one KIVI head's bytes go for a request of `num_tokens` (preempt/kernels/kivi_ref.py)."""

    num_sink: int  # tokens [0, num_sink) kept at full precision
    num_mid: int  # tokens [num_sink, num_sink + num_mid) quantized
    num_recent: int  # the last num_recent tokens kept at full precision
    num_k_groups: int  # key groups of group_size tokens over the quantized span (last may be short)
    v_group: int  # channels per value group
    full_bytes: int  # (2, num_sink + num_recent, D) in the cache dtype
    k_code_bytes: int  # (num_mid, D * key bits / 8)
    v_code_bytes: int  # (num_mid, D * value bits / 8)
    k_param_bytes: int  # (num_k_groups, D, 2) float16: min, scale
    v_param_bytes: int  # (num_mid, D / v_group, 2) float16: min, scale

    @property
    def nbytes(self) -> int:
        return (
            self.full_bytes + self.k_code_bytes + self.v_code_bytes + self.k_param_bytes + self.v_param_bytes
        )


def kivi_layout(
    bits: tuple[int, int], num_tokens: int, head_dim: int, itemsize: int, params: tuple[int, int, int]
) -> KiviLayout:
    """The byte layout of one KIVI head (raises ValueError if `head_dim` does not pack)."""
    group_size, num_sink, num_recent = params
    for b in bits:
        if head_dim * b % 8:
            raise ValueError(
                f"{b}-bit KIVI packs head_dim {head_dim} into whole bytes only if head_dim * {b} % 8 == 0"
            )
    v_group = min(group_size, head_dim)
    if head_dim % v_group:
        raise ValueError(f"KIVI value groups of {v_group} channels do not divide head_dim {head_dim}")
    sink = min(num_sink, num_tokens)
    recent = min(num_recent, num_tokens - sink)
    mid = num_tokens - sink - recent
    num_k_groups = -(-mid // group_size)
    return KiviLayout(
        sink,
        mid,
        recent,
        num_k_groups,
        v_group,
        2 * (sink + recent) * head_dim * itemsize,
        mid * head_dim * bits[0] // 8,
        mid * head_dim * bits[1] // 8,
        num_k_groups * head_dim * 2 * 2,
        mid * (head_dim // v_group) * 2 * 2,
    )


def head_bytes(
    cls: HeadClass, num_tokens: int, head_dim: int, itemsize: int, params: tuple[int, int, int]
) -> int:
    """Stored bytes of one head of class `cls` (K and V, scales included) for a request of
    `num_tokens`, full-precision parts at `itemsize` bytes per element."""
    if cls == HeadClass.FP16:
        return 2 * num_tokens * head_dim * itemsize
    if cls == HeadClass.FP8:
        return 2 * num_tokens * head_dim + 2 * SCALE_BYTES
    if cls == HeadClass.DROP:
        return 0
    if cls == HeadClass.FP8_TOKEN:
        return 2 * num_tokens * (head_dim + SCALE_BYTES)
    return kivi_layout(KIVI_BITS[cls], num_tokens, head_dim, itemsize, params).nbytes


def stored_bytes(plan: HeadPlan, num_tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Exact stored bytes of one request's KV under `plan` (every section, scales
    included; the blob adds its header and the plan codes), for a cache of `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(
        plan.count(cls) * head_bytes(cls, num_tokens, head_dim, itemsize, plan.params()) for cls in HeadClass
    )


def size_vs_fp16(plan: HeadPlan, num_tokens: int, head_dim: int) -> float:
    """`stored_bytes` at a 16-bit cache over the 16-bit KV: what the plan stores on a GPU
    deployment, for a request of `num_tokens`."""
    total = plan.num_layers * plan.num_kv_heads * 2 * num_tokens * head_dim * 2
    return stored_bytes(plan, num_tokens, head_dim, torch.float16) / total


def scale_bytes(plan: HeadPlan) -> int:
    """Per-request bytes of FP8 scales: one float32 for K and one for V per FP8 head."""
    return 2 * plan.num_fp8 * SCALE_BYTES


def _check_dims(num_layers: int, num_kv_heads: int) -> None:
    if num_layers <= 0 or num_kv_heads <= 0:
        raise ValueError(
            f"a head plan needs num_layers > 0 and num_kv_heads > 0, got {num_layers}, {num_kv_heads}"
        )


def _counts(num_heads: int, fp8_share: float, drop_share: float) -> tuple[int, int]:
    for name, share in (("fp8_share", fp8_share), ("drop_share", drop_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {share}")
    if fp8_share + drop_share > 1.0 + 1e-9:
        raise ValueError(f"fp8_share + drop_share must be <= 1, got {fp8_share} + {drop_share}")
    num_drop = round(drop_share * num_heads)
    num_fp8 = min(round(fp8_share * num_heads), num_heads - num_drop)
    return num_fp8, num_drop
