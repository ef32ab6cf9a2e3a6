"""Fit the virtual clock to a real vLLM's own steps.

Owns: reading the step logs that vLLM writes with preempt's step logger
(`preempt.integrations.vllm.steplog`: every step's shape and wall time), turning them into
(step shape, seconds) pairs, and the fit of a target profile to them: the served model's
shape from the log's header, the device constants of `preempt.core.cost_model`'s formula
fitted so that the formula's step time matches the measured one. The profile is a
target file `clock.target` loads by path, so the engine replays on the clock of that
deployment: fit the simulator to your own vLLM on any hardware, then compare policies on
it (`preempt calibrate --from vllm --steps LOG... --out target.json`).

What a step costs here is measured from one `schedule()` to the next while the engine is
busy (synchronous scheduling: schedule, forward, update, the engine core's own loop): the
host's work is inside it. Steps before an idle gap have no next start and are not used.

Which constants whole steps can tell apart: the GEMMs' FLOP and byte rates and their knee,
attention's KV and FLOP rates and its per-row cost, and one constant per step. The
elementwise kernels stream at the GEMMs' byte rate (both grow with the step's tokens; apart,
the fit drives one of them to infinity). Per-kernel floors (launches, the last wave) are a
constant per step of a given model and so cannot be told apart from the host's per-step
work: they are folded into `cpu_step_overhead_s` and written as 0. Fitted on log time
(a 15 ms decode and a 1 s prefill weigh the same), with a pseudo-Huber loss (scale
`ROBUST_SCALE`): a step the OS or the garbage collector stretched does not pull the fit's
shape. Then every time is scaled by one factor so that the fitted steps add up to the
measured ones: the shape is the typical step's, the total is the mean's, which is what a
replay's clock adds up.
Deterministic: the same logs give the same profile.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from preempt.calibrate.fit import (
    _exponent,
    attention_predict,
    elementwise_predict,
    levenberg_marquardt,
    linear_predict,
)
from preempt.core.cost_model import CostModel, StepShape, step_shape
from preempt.core.profiles import ELEMENTWISE_OPS, DeviceProfile, ModelShape, ProfileError, TargetProfile

UNBOUNDED_RATE = 1e18  # per second: a term at this rate costs nothing measurable
ROBUST_SCALE = 0.1  # log-time residuals past ~10% count linearly, not squared
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Attention's masked pairs inside a chunk: whole steps cannot separate them from the
# chunk's other prefill work (both grow with the chunk), so the kernel is taken to compute
# them all, as the profiled GPU kernel does (preempt.calibrate.fit.PROFILED_MASKED_SHARE).
MASKED_SHARE = 1.0


@dataclass(frozen=True)
class StepLog:
    """One step log: its header and records by kind (in file order)."""

    path: Path
    header: dict[str, Any]
    steps: list[dict[str, Any]]
    adds: list[dict[str, Any]]
    finishes: list[dict[str, Any]]


def read_step_log(path: str | Path) -> StepLog:
    """A step log file (`.gz`: gzipped); a missing header or an unreadable line raises ProfileError naming
    the file and line (a server killed mid-write leaves at most a partial last line, which
    is skipped)."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            import gzip

            lines = gzip.decompress(path.read_bytes()).decode().splitlines()
        else:
            lines = path.read_text().splitlines()
    except OSError as err:
        raise ProfileError(f"cannot read step log {path}: {err.strerror}") from None
    header: dict[str, Any] | None = None
    kinds: dict[str, list[dict[str, Any]]] = {"step": [], "add": [], "finish": []}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ProfileError(f"{path.name}: line {number} is not JSON") from None
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "header":
            header = header or record
        elif kind in kinds:
            kinds[kind].append(record)
        else:
            raise ProfileError(f"{path.name}: line {number}: unknown record kind {kind!r}")
    if header is None:
        raise ProfileError(f"{path.name}: no header line: not a vLLM step log")
    return StepLog(path, header, kinds["step"], kinds["add"], kinds["finish"])


def model_shape(header: dict[str, Any]) -> ModelShape:
    """The served model's shape, as the cost model reads it, from a log's header."""
    try:
        fields = dict(header["model"])
        dtype = header["dtype"]
    except (KeyError, TypeError):
        raise ProfileError("step log header: missing 'model' or 'dtype'") from None
    if dtype not in DTYPE_BYTES:
        raise ProfileError(f"step log header: dtype {dtype!r} unknown; known {sorted(DTYPE_BYTES)}")
    return ModelShape(**fields, dtype_bytes=DTYPE_BYTES[dtype])


def timed_steps(log: StepLog, since: float = -math.inf, until: float = math.inf) -> list[tuple[dict, float]]:
    """(step, seconds) for every step that computed tokens, began in [since, until) and was
    followed at once by another (the engine stayed busy)."""
    out = []
    for step, after in zip(log.steps, log.steps[1:], strict=False):
        if step["busy"] and step["chunks"] and since <= step["t"] < until:
            out.append((step, after["t"] - step["t"]))
    return out


def shape_of(step: dict[str, Any]) -> StepShape:
    return step_shape((int(before), int(new)) for before, new in step["chunks"])


# ------------------------------------------------------------------------- the fit
_SHAPE_ONLY = dict(
    linear_flops_per_s=1.0, linear_bytes_per_s=1.0, linear_exponent=2.0, linear_floor_s=0.0,
    elementwise={op: (0.0, 1.0, 0.0, 2.0) for op in (*ELEMENTWISE_OPS, "emb")},
    attn_kv_bytes_per_s=1.0, attn_flops_per_s=1.0, attn_exponent=2.0, attn_floor_s=0.0,
    attn_per_row_head_s=0.0, attn_masked_share=MASKED_SHARE, all_reduce={2: (0.0, 1.0)},
    cpu_step_overhead_s=0.0, copy_one_way_bytes_per_s=1.0, copy_both_ways_bytes_per_s=1.0,
    copy_latency_s=0.0, mem_total_bytes=1.0,
)  # fmt: skip


class _Features:
    """The per-step quantities the formula multiplies the constants by (numpy, one entry
    per step), from the cost model's own bookkeeping of the model's shape."""

    def __init__(self, model: ModelShape, shapes: Sequence[StepShape]) -> None:
        cost = CostModel(TargetProfile("fit", model, 1, DeviceProfile(name="shape-only", **_SHAPE_ONLY)))
        t = np.array([s.num_tokens for s in shapes], dtype=float)
        seqs = np.array([s.num_seqs for s in shapes], dtype=float)
        self.num_layers = model.num_layers
        self.gemms = [(2.0 * t * k * n, 2.0 * (k * n + t * k + t * n)) for _, k, n in cost._layer_gemms]
        h, v = model.hidden_size, model.vocab_size
        self.lm_head = (2.0 * seqs * h * v, 2.0 * (h * v + seqs * h + seqs * v))
        per_token = {**cost._elementwise_bytes, "emb": 2 * cost._allreduce_bytes_per_token}
        self.elementwise = [(op, t * per_token[op], np.full_like(t, per_token[op])) for op in per_token]
        kv = np.array([s.sum_kv_read for s in shapes], dtype=float) * cost._kv_bytes_per_ctx
        pairs = np.array([s.sum_attn_ctx + MASKED_SHARE * s.sum_masked_ctx for s in shapes], dtype=float)
        self.attention = (kv, pairs * cost._attn_flops_per_ctx, cost._q_heads * (t - seqs))

    def predict(self, x: np.ndarray) -> np.ndarray:
        lin = np.r_[x[0:3], -np.inf]  # log flops/s, log bytes/s, knee; floor 0
        step = sum(linear_predict(lin, f, b) for f, b in self.gemms) * self.num_layers
        step = step + linear_predict(lin, *self.lm_head)
        ew = np.array([-np.inf, x[1], -np.inf, 0.0])  # floor 0, the GEMMs' byte rate, p = 2
        for op, nbytes, row in self.elementwise:
            step = step + elementwise_predict(ew, nbytes, row) * (1 if op == "emb" else self.num_layers)
        attn = np.array([x[3], x[4], 0.0, -np.inf, x[5]])  # kv, flops, p = 2, floor 0, per row
        step = step + attention_predict(attn, *self.attention) * self.num_layers
        return step + np.exp(x[6])


# (name, start) of the fitted log-constants, in `_Features.predict`'s order
_PARAMS = (
    ("linear_flops_per_s", 50e9),
    ("linear_bytes_per_s", 20e9),
    ("linear_exponent", None),  # log(p - 1): p = 3 to start
    ("attn_kv_bytes_per_s", 10e9),
    ("attn_flops_per_s", 20e9),
    ("attn_per_row_head_s", 1e-7),
    ("cpu_step_overhead_s", 3e-3),
)


def _pseudo_huber(r: np.ndarray) -> np.ndarray:
    """Residuals whose squares are the pseudo-Huber loss of `r` (quadratic near 0, linear
    past ROBUST_SCALE)."""
    c = ROBUST_SCALE
    return np.sign(r) * np.sqrt(2.0 * c * c * (np.sqrt(1.0 + (r / c) ** 2) - 1.0))


_RATES = ("linear_flops_per_s", "linear_bytes_per_s", "attn_kv_bytes_per_s", "attn_flops_per_s")
_SECONDS = ("attn_per_row_head_s", "cpu_step_overhead_s")


def slowed(fitted: dict[str, float], k: float) -> dict[str, float]:
    """The fitted constants with every step k times as long: the formula is homogeneous in
    time with its floors at 0 (rates / k, seconds x k)."""
    out = dict(fitted)
    for name in _RATES:
        out[name] /= k
    for name in _SECONDS:
        out[name] *= k
    return out


def slowed_target(target: str | Path, k: float, out: str | Path) -> Path:
    """A copy of the calibrated target file `target` whose steps take k times as long
    (the host copy rate kept: it is measured apart), written to `out`."""
    data = json.loads(Path(target).read_text())
    device = data["device"]
    device.update(slowed({name: device[name] for name in (*_RATES, *_SECONDS)}, k))
    for op, (floor_s, bytes_per_s, row_s_per_byte, p) in device["elementwise"].items():
        device["elementwise"][op] = [floor_s * k, bytes_per_s / k, row_s_per_byte * k, p]
    data["name"] = f"{data['name']}-x{k:.3f}"
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return Path(out)


def fit_steps(model: ModelShape, shapes: Sequence[StepShape], seconds: Sequence[float]) -> dict[str, float]:
    """The fitted constants (see the module's docstring for which, and why)."""
    if len(shapes) < len(_PARAMS) * 4:
        raise ProfileError(f"{len(shapes)} timed steps are too few to fit {len(_PARAMS)} constants")
    features = _Features(model, shapes)
    measured = np.asarray(seconds, dtype=float)

    def residuals(x: np.ndarray) -> np.ndarray:
        return _pseudo_huber(np.log(features.predict(x) / measured))

    x0 = [math.log(2.0) if start is None else math.log(start) for _, start in _PARAMS]
    x = levenberg_marquardt(residuals, x0)
    # The robust fit on log time follows the typical step; a replay's clock adds steps up,
    # so every time is scaled to make the fitted steps' sum the measured sum (the
    # formula is homogeneous in time with its floors at 0: rates / k, seconds x k).
    k = float(measured.sum() / features.predict(x).sum())
    # a constant the steps do not bound from below (its term never matters) is written as 0
    logs = dict(zip((name for name, _ in _PARAMS), x, strict=True))
    fitted = slowed({name: float(np.exp(value)) if value > -40 else 0.0 for name, value in logs.items()}, k)
    # a rate the steps do not bound from above (its term is below their noise; on a CPU,
    # decode attention's KV reads next to the weights') is written as UNBOUNDED_RATE
    for name in _RATES:
        fitted[name] = min(fitted[name], UNBOUNDED_RATE)
    fitted["linear_exponent"] = _exponent(x[2])
    return fitted


def device_profile(name: str, fitted: dict[str, float], what: str, copy: tuple[float, str]) -> DeviceProfile:
    """The fitted constants as a device profile; `copy`: the host copy rate (bytes/s) and
    where it comes from (saves and restores of the swap modes)."""
    source = f"fit: {what}"
    ew = (0.0, fitted["linear_bytes_per_s"], 0.0, 2.0)
    folded = "0: a constant per step, folded into cpu_step_overhead_s (whole steps cannot tell them apart)"
    rate, rate_source = copy
    values = dict(
        linear_flops_per_s=fitted["linear_flops_per_s"],
        linear_bytes_per_s=fitted["linear_bytes_per_s"],
        linear_exponent=fitted["linear_exponent"],
        linear_floor_s=0.0,
        elementwise={op: ew for op in (*ELEMENTWISE_OPS, "emb")},
        attn_kv_bytes_per_s=fitted["attn_kv_bytes_per_s"],
        attn_flops_per_s=fitted["attn_flops_per_s"],
        attn_exponent=2.0,
        attn_floor_s=0.0,
        attn_per_row_head_s=fitted["attn_per_row_head_s"],
        attn_masked_share=MASKED_SHARE,
        all_reduce={2: (0.0, 1e12)},
        cpu_step_overhead_s=fitted["cpu_step_overhead_s"],
        copy_one_way_bytes_per_s=rate,
        copy_both_ways_bytes_per_s=rate,
        copy_latency_s=0.0,
        mem_total_bytes=64e9,
    )
    sources = {k: source for k in values}
    sources.update(
        linear_floor_s=folded, attn_floor_s=folded,
        elementwise=f"fit: {what}: every kernel streams at the GEMMs' byte rate (whole steps cannot "
        f"tell the two apart), floors {folded}",
        attn_exponent="fixed (2): not identifiable from whole steps",
        attn_masked_share="fixed (1): the chunk's masked pairs grow with its other prefill work",
        all_reduce="unused: one device, no tensor parallelism",
        copy_one_way_bytes_per_s=rate_source, copy_both_ways_bytes_per_s=rate_source,
        copy_latency_s="0: not measured", mem_total_bytes="unused: the run sets cache.num_blocks",
    )  # fmt: skip
    return DeviceProfile(name=name, sources=sources, **values)  # type: ignore[arg-type]


def host_copy_rate(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """This machine's host memory copy rate (bytes/s, the best of `repeats`): on a CPU
    deployment a KV save or restore is such a copy."""
    import time

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


def errors(cost: CostModel, pairs: Iterable[tuple[StepShape, float]]) -> dict[str, float]:
    """How the profile's step times compare with measured ones: RMS log error, mean and
    median of predicted / measured, and the ratio of the sums (the clock's drift)."""
    predicted, measured = [], []
    for shape, seconds in pairs:
        predicted.append(cost.step_time_s(shape))
        measured.append(seconds)
    if not measured:
        return {"steps": 0}
    p, m = np.array(predicted), np.array(measured)
    ratio = p / m
    return {
        "steps": len(m),
        "rms_log": round(float(np.sqrt(np.mean(np.log(ratio) ** 2))), 4),
        "mean_ratio": round(float(ratio.mean()), 4),
        "median_ratio": round(float(np.median(ratio)), 4),
        "sum_ratio": round(float(p.sum() / m.sum()), 4),
        "within_10pct": round(float(np.mean(np.abs(ratio - 1) <= 0.10)), 3),
    }


def calibrate_vllm(
    paths: Sequence[str | Path],
    name: str = "vllm",
    windows: Sequence[tuple[float, float]] | None = None,
    copy: tuple[float, str] | None = None,
) -> dict[str, Any]:
    """Fit a target profile to step logs (every timed step, or those that began inside
    `windows`, [since, until) in the logs' clock). Returns the target file's content:
    `{"name", "model", "num_gpus", "device", "fit"}`; `fit` says what it was fitted on and
    how well it fits those steps."""
    logs = [read_step_log(p) for p in paths]
    if not logs:
        raise ProfileError("calibrate --from vllm: no step logs given")
    model = model_shape(logs[0].header)
    for log in logs[1:]:
        if model_shape(log.header) != model:
            raise ProfileError(f"{log.path.name}: a different model than {logs[0].path.name}")
    spans = list(windows) if windows is not None else [(-math.inf, math.inf)]
    pairs = [(shape_of(step), s) for log in logs for a, b in spans for step, s in timed_steps(log, a, b)]
    if not pairs:
        raise ProfileError("the step logs have no timed steps (a busy step followed by another)")
    fitted = fit_steps(model, [p[0] for p in pairs], [p[1] for p in pairs])
    names = ", ".join(p.path.name for p in logs)
    what = f"{len(pairs)} steps of vLLM {logs[0].header.get('vllm_version', '?')} ({names})"
    if copy is None:
        copy = (
            host_copy_rate(),
            "measured: a 64 MiB host memory copy on the calibrating machine (best of 5)",
        )
    device = device_profile(name, fitted, what, copy)
    target = TargetProfile(name, model, 1, device)
    return {
        "name": name,
        "model": dataclasses.asdict(model),
        "num_gpus": 1,
        "device": device.to_dict(),
        "fit": {"steps": len(pairs), "logs": [p.path.name for p in logs], **errors(CostModel(target), pairs)},
    }
