"""Fit the cost model's device constants to measured operator times.

Owns: the least-squares fit (Levenberg-Marquardt on log time, so a 10 us kernel and a
10 ms GEMM weigh the same), which measured sets fit which constants, and the derivation
of a device nobody profiled (H200) from one that was (H100). Each fitted constant is
written with its source. Deterministic: same data -> same constants.

Which data fits what (`FIT_SETS`; the rest is held out and reported by `preempt bench clock`):
- H100: linear + elementwise from Llama-2-7B at TP 1/2/4/8; all-reduce from H100 DGX.
  Attention: none measured on H100 -> A100's fit with its rates scaled (stated below).
- A100: linear + elementwise from Llama-3-8B at TP 1/2/4/8; attention from the A100
  attention file (Llama-70B shape over 2 GPUs); all-reduce from A100 DGX.
Held out: H100 Llama-2-70B, A100 Llama-3-70B and Llama-2-7B.

Beside the constants, every measured per-token operator time goes into the profile's
`op_tables` (all models and GPU counts, the held-out ones too: tables are measurements, not
fitted), which a target of that model and GPU count charges as Vidur does; the held-out
check of the constants (`preempt bench clock`) runs without them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from preempt.calibrate.vidur import AllReducePoint, AttnPoint, OpPoint
from preempt.core.cost_model import CostModel
from preempt.core.profiles import ELEMENTWISE_OPS, MODELS, TABLE_OPS, DeviceProfile, TargetProfile

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
FIT_SETS = {"h100": ("llama2-7b",), "a100": ("llama3-8b",)}
VIDUR = "Vidur profiles (microsoft/vidur, MIT; preempt/profiles/vidur)"

# Datasheet rates used only to carry a fit from one GPU to another (ratios, never as peaks)
HBM_BYTES_PER_S = {"a100": 2.039e12, "h100": 3.35e12, "h200": 4.8e12}  # NVIDIA datasheets (SXM)

# Stated assumptions for what Vidur does not measure (replaced by `calibrate --device cuda`).
# Issue #13's duplex PCIe Gen5 x16 measurement: ~50 GB/s one way, ~83 GB/s both ways together.
COPY_ONE_WAY = 50e9
COPY_BOTH_WAYS = 83e9
COPY_ONE_WAY_A100 = 25e9  # PCIe Gen4 x16: half of Gen5 (assumption)
COPY_BOTH_WAYS_A100 = 41.5e9
CPU_STEP_OVERHEAD_S = 1e-3  # vLLM V1 scheduler + input prep + sampling per step (assumption)
# nvidia-smi memory.total: H200 143771 MiB, H100 81559 MiB, A100-80GB 81920 MiB (public
# nvidia-smi logs; modal-labs/modal-client#2797 lists H100 and A100).
MEM_TOTAL = {"h200": 143771 * 2**20, "h100": 81559 * 2**20, "a100": 81920 * 2**20}


# ------------------------------------------------------------------------ solver
def levenberg_marquardt(
    residuals: Callable[[np.ndarray], np.ndarray], x0: Sequence[float], max_iter: int = 200
) -> np.ndarray:
    """Minimise sum(residuals(x)^2) from x0 (numeric Jacobian; a handful of parameters)."""
    x = np.asarray(x0, dtype=float)
    r = residuals(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(max_iter):
        jac = np.empty((r.size, x.size))
        for i in range(x.size):
            step = 1e-6 * max(1.0, abs(x[i]))  # forward difference
            xp = x.copy()
            xp[i] += step
            jac[:, i] = (residuals(xp) - r) / step
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e10:
            delta = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -jtr)
            candidate = np.clip(x + delta, -100.0, 100.0)  # log-parameters: exp() stays finite
            rc = residuals(candidate)
            cost_c = float(rc @ rc)
            if np.isfinite(cost_c) and cost_c < cost:
                improved = True
                converged = cost - cost_c < 1e-12 * max(cost, 1e-30)
                x, r, cost, lam = candidate, rc, cost_c, max(lam / 3, 1e-9)
                break
            lam *= 4
        if not improved or converged:
            break
    return x


def _exponent(q: float) -> float:
    """p = 1 + e^q in (1, 33]: 33 is already a sharp max (it differs from max() by < 2.2%)."""
    return float(1.0 + min(math.exp(min(q, 10.0)), 32.0))


def _smooth_max(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    hi = np.maximum(np.maximum(a, b), 1e-30)
    return hi * ((a / hi) ** p + (b / hi) ** p) ** (1.0 / p)


# ---------------------------------------------------------------- fitted pieces
def linear_features(points: Sequence[OpPoint]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flops, bytes, measured_s) of each GEMM point, per GPU shard."""
    flops, nbytes, measured = [], [], []
    dims: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}
    for p in points:
        key = (p.model, p.tp)
        if key not in dims:
            dims[key] = {op: (k, n) for op, k, n in _cost(p.model, p.tp)._layer_gemms}
        k, n = dims[key][p.op]
        m = p.num_tokens
        flops.append(2.0 * m * k * n)
        nbytes.append(2.0 * (k * n + m * k + m * n))
        measured.append(p.measured_s)
    return np.array(flops), np.array(nbytes), np.array(measured)


def linear_predict(params: np.ndarray, flops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """params: log(flops/s), log(bytes/s), log(p - 1), log(floor_s)."""
    f, b, p, floor = np.exp(params[0]), np.exp(params[1]), _exponent(params[2]), np.exp(params[3])
    return floor + _smooth_max(flops / f, nbytes / b, p)


def fit_linear(points: Sequence[OpPoint]) -> dict[str, float]:
    flops, nbytes, measured = linear_features(points)
    x0 = [math.log(5e14), math.log(2.5e12), math.log(3.0), math.log(3e-6)]
    x = levenberg_marquardt(lambda q: np.log(linear_predict(q, flops, nbytes) / measured), x0)
    return {
        "linear_flops_per_s": float(np.exp(x[0])),
        "linear_bytes_per_s": float(np.exp(x[1])),
        "linear_exponent": _exponent(x[2]),
        "linear_floor_s": float(np.exp(x[3])),
    }


def elementwise_bytes(points: Sequence[OpPoint]) -> tuple[np.ndarray, np.ndarray]:
    """(bytes moved, one token's bytes) of each elementwise point, per GPU shard."""
    total, row = [], []
    for p in points:
        cost = _cost(p.model, p.tp)
        per_token = cost._elementwise_bytes[p.op] if p.op != "emb" else 2 * cost._allreduce_bytes_per_token
        total.append(float(per_token * p.num_tokens))
        row.append(float(per_token))
    return np.array(total), np.array(row)


def elementwise_predict(params: np.ndarray, nbytes: np.ndarray, row: np.ndarray) -> np.ndarray:
    """params: log(floor_s), log(bytes/s), log(row s/byte), log(p - 1)."""
    lead = np.exp(params[0]) + row * np.exp(params[2])
    return _smooth_max(lead, nbytes / np.exp(params[1]), _exponent(params[3]))


def fit_elementwise_bytes(
    nbytes: np.ndarray, row: np.ndarray, measured: np.ndarray
) -> tuple[float, float, float, float]:
    """(floor_s, bytes_per_s, row_s_per_byte, exponent) of one elementwise op. The row term
    is fitted only where the row width varies (the TP shards of a wide row); with one width
    it is the floor under another name, so 0."""
    varies = float(row.max()) > float(row.min())

    def residuals(q: np.ndarray) -> np.ndarray:
        return np.log(
            elementwise_predict(q if varies else np.r_[q[:2], -100.0, q[2:]], nbytes, row) / measured
        )

    # The knee has local minima: nine starts (floor x knee sharpness p = 2, 3.7, 21), the
    # lowest cost wins (deterministic).
    starts = [
        [math.log(floor), math.log(1e12), *([math.log(1e-10)] if varies else []), q]
        for floor in (float(measured.min()) / 2, float(measured.min()), 2e-6)
        for q in (0.0, 1.0, 3.0)
    ]
    fits = [levenberg_marquardt(residuals, x0) for x0 in starts]
    x = min(fits, key=lambda q: float(residuals(q) @ residuals(q)))
    if not varies:
        x = np.r_[x[:2], -100.0, x[2:]]
    row_s = float(np.exp(x[2])) if varies else 0.0
    return float(np.exp(x[0])), float(np.exp(x[1])), row_s, _exponent(x[3])


def fit_elementwise(points: Sequence[OpPoint]) -> tuple[float, float, float, float]:
    """(floor_s, bytes_per_s, row_s_per_byte, exponent) of one elementwise op."""
    nbytes, row = elementwise_bytes(points)
    return fit_elementwise_bytes(nbytes, row, np.array([p.measured_s for p in points]))


# The profiled A100 kernel (an early FlashAttention) does not skip masked tiles: its
# prefill time grows with the whole chunk square (docs/clock.md), so the fit charges every
# masked pair. Fixed, not fitted: left free it stays near 1 and the fit does not improve.
PROFILED_MASKED_SHARE = 1.0
ATTN_KEYS = (
    "attn_kv_bytes_per_s",
    "attn_flops_per_s",
    "attn_exponent",
    "attn_floor_s",
    "attn_per_row_head_s",
)


def attention_features(
    points: Sequence[AttnPoint], masked_share: float = PROFILED_MASKED_SHARE
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(KV bytes read, FLOPs computed, prefill rows x query heads, measured_s) per layer on one GPU."""
    kv = np.array([p.sum_kv_read * 4.0 * p.num_kv_heads / p.tp * p.head_dim for p in points])
    pairs = np.array([p.sum_attn_ctx + masked_share * p.sum_masked_ctx for p in points])
    flops = pairs * np.array([4.0 * p.num_q_heads / p.tp * p.head_dim for p in points])
    rows = np.array([float(p.prefill_rows * p.num_q_heads // p.tp) for p in points])
    return kv, flops, rows, np.array([p.measured_s for p in points])


def attention_predict(params: np.ndarray, kv: np.ndarray, flops: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """params: log(kv bytes/s), log(flops/s), log(p - 1), log(floor_s), log(per_row_head_s)."""
    b, f, p, floor = np.exp(params[0]), np.exp(params[1]), _exponent(params[2]), np.exp(params[3])
    return floor + np.exp(params[4]) * rows + _smooth_max(kv / b, flops / f, p)


def _attention_params(x: np.ndarray) -> dict[str, float]:
    return {
        "attn_kv_bytes_per_s": float(np.exp(x[0])),
        "attn_flops_per_s": float(np.exp(x[1])),
        "attn_exponent": _exponent(x[2]),
        "attn_floor_s": float(np.exp(x[3])),
        "attn_per_row_head_s": float(np.exp(x[4])),
    }


def fit_attention(
    points: Sequence[AttnPoint], masked_share: float = PROFILED_MASKED_SHARE
) -> dict[str, float]:
    """The attention constants; `masked_share` is the kernel's (not fitted, see above)."""
    kv, flops, rows, measured = attention_features(points, masked_share)

    def residuals(q: np.ndarray) -> np.ndarray:
        return np.log(attention_predict(q, kv, flops, rows) / measured)

    # Two starts, a soft and a sharp knee (p = 3, p = 33): five coupled constants have
    # more than one local minimum; the lower cost wins (deterministic).
    fits = [
        levenberg_marquardt(
            residuals, [math.log(1.5e12), math.log(1.5e14), q, math.log(1.5e-5), math.log(2e-9)]
        )
        for q in (math.log(2.0), 10.0)
    ]
    x = min(fits, key=lambda x: float(residuals(x) @ residuals(x)))
    return {**_attention_params(x), "attn_masked_share": masked_share}


def fit_all_reduce(points: Sequence[AllReducePoint]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) for one GPU count; Vidur's size is fp16 elements."""
    nbytes = np.array([2.0 * p.num_bytes for p in points])
    measured = np.array([p.measured_s for p in points])
    x = levenberg_marquardt(
        lambda q: np.log((np.exp(q[0]) + nbytes / np.exp(q[1])) / measured), [math.log(2e-5), math.log(2e11)]
    )
    return float(np.exp(x[0])), float(np.exp(x[1]))


def _cost(model: str, tp: int) -> CostModel:
    return CostModel(TargetProfile(f"fit-{model}", MODELS[model], tp, _SHAPE_ONLY))


# A device whose constants are never read: CostModel's shape bookkeeping only.
_SHAPE_ONLY = DeviceProfile(
    "shape-only",
    1,
    1,
    2,
    0,
    {op: (0, 1, 0, 2) for op in (*ELEMENTWISE_OPS, "emb")},
    1,
    1,
    2,
    0,
    0,
    1,
    {n: (0, 1) for n in (2, 4, 8)},
    0,
    1,
    1,
    0,
    1,
)


# ------------------------------------------------------------------- devices
def fit_device(
    gpu: str,
    ops: Sequence[OpPoint],
    attention: Sequence[AttnPoint],
    all_reduce: Sequence[AllReducePoint],
    models: Sequence[str] | None = None,
    attention_from: tuple[dict[str, float], str] | None = None,
) -> DeviceProfile:
    """A DeviceProfile for `gpu` from the Vidur points of `models` (default FIT_SETS)."""
    models = tuple(models or FIT_SETS[gpu])
    mine = [p for p in ops if p.gpu == gpu and p.model in models]
    if not mine:
        raise ValueError(f"no operator points for {gpu} {models}")
    sets = "+".join(models)
    sources: dict[str, str] = {}
    values: dict[str, object] = dict(fit_linear([p for p in mine if p.op in LINEAR_OPS]))
    for key in values:
        sources[key] = f"fit: {VIDUR} {gpu} {sets} QKV/O/up/down GEMMs, TP 1-8"
    values["elementwise"] = {
        op: fit_elementwise([p for p in mine if p.op == op]) for op in (*ELEMENTWISE_OPS, "emb")
    }
    sources["elementwise"] = f"fit per op: {VIDUR} {gpu} {sets}"
    attn = [p for p in attention if p.gpu == gpu]
    if attn:
        values.update(fit_attention(attn))
        for key in ATTN_KEYS:
            sources[key] = f"fit: {VIDUR} {gpu} attention (Llama-70B shape, TP 2, decode + prefill)"
        sources["attn_masked_share"] = (
            f"fixed: {VIDUR} {gpu} attention's kernel (early FlashAttention) computes the whole "
            "chunk square, masked tiles included (its prefill time follows it)"
        )
    elif attention_from is not None:
        values.update(attention_from[0])
        sources.update({k: attention_from[1] for k in attention_from[0]})
    else:
        raise ValueError(f"no attention points for {gpu} and no attention_from")
    counts = sorted({p.num_gpus for p in all_reduce if p.gpu == gpu})
    values["all_reduce"] = {
        n: fit_all_reduce([p for p in all_reduce if p.gpu == gpu and p.num_gpus == n]) for n in counts
    }
    sources["all_reduce"] = f"fit per GPU count: {VIDUR} {gpu} DGX all-reduce (NVLink, one node)"
    values["cpu_step_overhead_s"] = CPU_STEP_OVERHEAD_S
    sources["cpu_step_overhead_s"] = "assumption: vLLM V1 ~1 ms host work per step (not in Vidur's data)"
    gen4 = gpu == "a100"
    values["copy_one_way_bytes_per_s"] = COPY_ONE_WAY_A100 if gen4 else COPY_ONE_WAY
    values["copy_both_ways_bytes_per_s"] = COPY_BOTH_WAYS_A100 if gen4 else COPY_BOTH_WAYS
    values["copy_latency_s"] = 0.0
    link = "PCIe Gen4: half of Gen5's" if gen4 else "PCIe Gen5 x16 duplex figures quoted in issue #13"
    sources["copy_one_way_bytes_per_s"] = sources["copy_both_ways_bytes_per_s"] = f"assumption: {link}"
    sources["copy_latency_s"] = "not measured (0) until `preempt calibrate --device cuda`"
    values["mem_total_bytes"] = float(MEM_TOTAL[gpu])
    sources["mem_total_bytes"] = f"nvidia-smi memory.total of {gpu.upper()} ({MEM_TOTAL[gpu] // 2**20} MiB)"
    return DeviceProfile(name=gpu, sources=sources, **values)  # type: ignore[arg-type]


def op_tables(points: Iterable[OpPoint]) -> dict[str, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]]:
    """Measured per-token operator times as `DeviceProfile.op_tables` ("model/tpN" -> op ->
    (token counts, seconds), 4 significant digits: the profiles' own precision)."""
    series: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for p in points:
        if p.op in TABLE_OPS:
            series[(f"{p.model}/tp{p.tp}", p.op)][p.num_tokens] = p.measured_s
    out: dict[str, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]] = {}
    for (key, op), by_tokens in sorted(series.items()):
        if len(by_tokens) >= 2:
            tokens = tuple(sorted(by_tokens))
            out.setdefault(key, {})[op] = (tokens, tuple(float(f"{by_tokens[t]:.4g}") for t in tokens))
    return out


def derive_device(base: DeviceProfile, name: str, base_gpu: str, compute_ratio: float = 1.0) -> DeviceProfile:
    """`base` carried to GPU `name`: every bandwidth term scaled by the datasheet HBM
    ratio, FLOP/s terms by `compute_ratio`, floors and exponents kept."""
    bw = HBM_BYTES_PER_S[name] / HBM_BYTES_PER_S[base_gpu]
    tb_s = HBM_BYTES_PER_S[name] / 1e12, HBM_BYTES_PER_S[base_gpu] / 1e12
    why = f"{base.name} x {bw:.3f} (HBM {tb_s[0]:.2f} / {tb_s[1]:.2f} TB/s datasheet)"
    data = base.to_dict()
    sources = dict(base.sources)
    for key in ("linear_bytes_per_s", "attn_kv_bytes_per_s"):
        data[key] *= bw
        sources[key] = f"derived: {why}; was {base.sources.get(key, '')}"
    data["elementwise"] = {op: [f, r * bw, row / bw, p] for op, (f, r, row, p) in base.elementwise.items()}
    sources["elementwise"] = f"derived: rates {why}; was {base.sources.get('elementwise', '')}"
    # FLOP/s scale with compute; the per-row attention time is compute work, so it shrinks
    data["linear_flops_per_s"] *= compute_ratio
    data["attn_flops_per_s"] *= compute_ratio
    data["attn_per_row_head_s"] /= compute_ratio
    for key, op in (("linear_flops_per_s", "x"), ("attn_flops_per_s", "x"), ("attn_per_row_head_s", "/")):
        if compute_ratio != 1.0:
            sources[key] = f"derived: {base.name} {op} {compute_ratio:.3f} (ratio of fitted GEMM FLOP/s)"
        else:
            sources[key] = f"kept: same compute die as {base.name}; was {base.sources.get(key, '')}"
    data["name"] = name
    data["op_tables"] = {}  # measured on the base GPU: not this one's times
    data["mem_total_bytes"] = float(MEM_TOTAL.get(name, base.mem_total_bytes))
    sources["mem_total_bytes"] = (
        f"nvidia-smi memory.total of {name.upper()} ({data['mem_total_bytes'] / 2**20:.0f} MiB)"
    )
    data["sources"] = sources
    return DeviceProfile.from_dict(data, where=name)


def fit_vidur() -> dict[str, DeviceProfile]:
    """a100 and h100 fitted, h200 derived from h100 (the three bundled device profiles)."""
    from preempt.calibrate import vidur

    ops, attention, all_reduce = vidur.load_ops(), vidur.load_attention(), vidur.load_all_reduce()
    a100 = fit_device("a100", ops, attention, all_reduce)
    h100_gemms = [p for p in ops if p.gpu == "h100" and p.model in FIT_SETS["h100"] and p.op in LINEAR_OPS]
    compute = fit_linear(h100_gemms)["linear_flops_per_s"] / a100.linear_flops_per_s
    # No H100 attention data in the bundle: A100's fit carried over, KV rate by the HBM
    # ratio and FLOP/s by the ratio of the two GPUs' fitted GEMM FLOP/s.
    carried = derive_device(a100, "h100", "a100", compute_ratio=compute)
    why = (
        f"A100 attention fit carried to H100 (KV bytes/s x HBM ratio "
        f"{HBM_BYTES_PER_S['h100'] / HBM_BYTES_PER_S['a100']:.3f}, FLOP/s x and per-row time / "
        f"GEMM ratio {compute:.3f})"
    )
    # The served kernel is not the profiled one: FlashAttention-2 and later skip the tiles
    # causal masking removes, so the H100 (and the H200 derived from it) pays the causal
    # pairs only, at the rate per computed pair fitted above.
    carried_attn = {**{k: getattr(carried, k) for k in ATTN_KEYS}, "attn_masked_share": 0.0}
    h100 = fit_device("h100", ops, [], all_reduce, attention_from=(carried_attn, why))
    data = h100.to_dict()
    data["sources"] = {
        **h100.sources,
        "attn_masked_share": "assumption: FlashAttention-2+ skips fully masked tiles (not in Vidur's data)",
    }
    h100 = DeviceProfile.from_dict(data, where="h100")
    h200 = derive_device(h100, "h200", "h100")
    # The A100 serves with the same kernels: its pairs rate was fitted per computed pair of
    # the profiled kernel (share 1, which `preempt bench clock` keeps for its attention
    # check), and the served kernel computes the causal pairs only.
    a100 = replace(
        a100,
        attn_masked_share=0.0,
        sources={
            **a100.sources,
            "attn_masked_share": "assumption: FlashAttention-2+ skips fully masked tiles; the profiled "
            f"kernel computed them (share {PROFILED_MASKED_SHARE:g} in the fit of attn_flops_per_s)",
        },
    )
    h100, a100 = (
        replace(
            dev,
            op_tables=op_tables(p for p in ops if p.gpu == dev.name),
            sources={**dev.sources, "op_tables": f"measured: {VIDUR} {dev.name}, every model and TP"},
        )
        for dev in (h100, a100)
    )
    return {"a100": a100, "h100": h100, "h200": h200}


# ------------------------------------------------------------ GPU measurements
def _fit_latency_rate(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    x = levenberg_marquardt(
        lambda q: np.log((np.exp(q[0]) + nbytes / np.exp(q[1])) / seconds),
        [math.log(max(float(seconds.min()) / 2, 1e-7)), math.log(float(nbytes.max() / seconds.max()))],
    )
    return float(np.exp(x[0])), float(np.exp(x[1]))


def fit_measurements(data: dict, base: DeviceProfile, name: str | None = None) -> DeviceProfile:
    """A device profile from `preempt.calibrate.gpu.measure()`'s output; what it does not
    measure (all-reduce, host overhead per step) is kept from `base`, and says so."""
    where = f"measured by `preempt calibrate --device cuda` on {data['device']} ({data['dtype']})"
    shape = data["shape"]
    b = 2 if data["dtype"] == "bfloat16" else 4
    h, d, hq, hkv, inter = (shape[k] for k in ("hidden", "head_dim", "q_heads", "kv_heads", "intermediate"))
    rows = [(t, k, n, s) for _, t, k, n, s in data["linear"]] + [tuple(r) for r in data["lm_head"]]
    m, k, n, sec = (np.array(col, dtype=float) for col in zip(*rows, strict=True))
    flops, nbytes = 2 * m * k * n, b * (k * n + m * k + m * n)
    x0 = [
        math.log(float(flops.max() / sec.max())),
        math.log(float(nbytes.min() / sec.min())),
        1.0,
        math.log(float(sec.min()) / 4),
    ]
    q = levenberg_marquardt(lambda p: np.log(linear_predict(p, flops, nbytes) / sec), x0)
    values: dict[str, object] = {
        "linear_flops_per_s": float(np.exp(q[0])),
        "linear_bytes_per_s": float(np.exp(q[1])),
        "linear_exponent": _exponent(q[2]),
        "linear_floor_s": float(np.exp(q[3])),
    }
    sources = {key: f"fit: {where}, GEMMs + LM head" for key in values}
    per_token = {
        "input_layernorm": 2 * h * b,
        "mlp_act": 3 * inter * b,
        "add": 3 * h * b,
        "attn_rope": 2 * (hq + hkv) * d * b,
    }
    elementwise = dict(base.elementwise)
    for op, bytes_per_token in per_token.items():
        pts = [(t, s) for o, t, s in data["elementwise"] if o == op]
        tokens, seconds = (np.array(col, dtype=float) for col in zip(*pts, strict=True))
        row = np.full_like(tokens, float(bytes_per_token))  # one model, one width: no row term
        elementwise[op] = fit_elementwise_bytes(tokens * bytes_per_token, row, seconds)
    elementwise["post_attention_layernorm"] = elementwise["input_layernorm"]  # the same kernel
    values["elementwise"] = elementwise
    sources["elementwise"] = f"fit per op: {where} (emb kept from {base.name})"
    attn = [
        AttnPoint(
            "gpu",
            hq,
            hkv,
            d,
            1,
            p["is_prefill"],
            p["batch_size"],
            p["kv_cache_size"],
            p["prefill_chunk_size"],
            p["seconds"],
        )
        for p in data["attention"]
    ]
    # SDPA with lower-right causal masking (gpu.py) skips the masked tiles, as served
    # kernels do: share 0; with an explicit mask (older measurements) it computes them all
    share = 0.0 if data.get("prefill_mask") == "causal_lower_right" else 1.0
    kv, attn_flops, rows, measured = attention_features(attn, masked_share=share)
    kv = kv * b / 2  # attention_features counts 2-byte KV
    x0 = [
        math.log(float(kv.max() / measured.max())),
        math.log(float(attn_flops.max() / measured.max())),
        1.0,
        math.log(float(measured.min()) / 2),
        math.log(float(measured.min()) / 1e4),  # per row and head: ~1e-4 of a call
    ]
    q = levenberg_marquardt(lambda p: np.log(attention_predict(p, kv, attn_flops, rows) / measured), x0)
    values.update({**_attention_params(q), "attn_masked_share": share})
    for key in ATTN_KEYS:
        sources[key] = f"fit: {where}, SDPA decode + prefill"
    sources["attn_masked_share"] = (
        f"fixed: {where}: SDPA with lower-right causal masking skips masked tiles"
        if share == 0.0
        else f"fixed: {where}: SDPA with an explicit mask computes every pair"
    )
    copies = data["copies"]
    sizes = np.array([c["bytes"] for c in copies] * 2, dtype=float)
    one_way = np.array([c["d2h_s"] for c in copies] + [c["h2d_s"] for c in copies])
    latency, rate = _fit_latency_rate(sizes, one_way)
    largest = max(copies, key=lambda c: c["bytes"])
    values["copy_latency_s"], values["copy_one_way_bytes_per_s"] = latency, rate
    values["copy_both_ways_bytes_per_s"] = 2 * largest["bytes"] / max(largest["both_s"] - latency, 1e-12)
    for key in ("copy_latency_s", "copy_one_way_bytes_per_s", "copy_both_ways_bytes_per_s"):
        sources[key] = f"fit: {where}, pinned copies 64 KB-256 MB"
    values["all_reduce"] = base.all_reduce
    values["cpu_step_overhead_s"] = base.cpu_step_overhead_s
    for key in ("all_reduce", "cpu_step_overhead_s"):
        sources[key] = f"kept from {base.name}: {base.sources.get(key, '')}"
    memory = data.get("memory")
    values["mem_total_bytes"] = float(memory["total_bytes"]) if memory else base.mem_total_bytes
    sources["mem_total_bytes"] = (
        f"torch.cuda.mem_get_info total on {data['device']}" if memory else f"kept from {base.name} (no CUDA)"
    )
    measured = measured_op_points(data)
    if measured:  # the measured stack is a known model's shape: its op times too
        values["op_tables"] = op_tables(measured)
        sources["op_tables"] = f"{where}: {measured[0].model} at TP 1, the GEMMs and elementwise kernels"
    return DeviceProfile(name=name or data["device"], sources=sources, **values)  # type: ignore[arg-type]


def measured_op_points(data: dict) -> list[OpPoint]:
    """A `preempt calibrate --device cuda` measurement's GEMM and elementwise times as op
    points of the bundled model whose shape it measured (none for `--tiny`'s toy shape);
    both RMSNorms are the one measured kernel."""
    model = _model_named(data["shape"])
    if model is None:
        return []
    points = [OpPoint("gpu", model, 1, op, t, sec) for op, t, _, _, sec in data["linear"]]
    points += [OpPoint("gpu", model, 1, op, t, sec) for op, t, sec in data["elementwise"]]
    points += [p._replace(op="post_attention_layernorm") for p in points if p.op == "input_layernorm"]
    return points


def _model_named(shape: dict) -> str | None:
    """The bundled model whose shape the measurement used, if any (`--tiny`'s is none)."""
    for name, m in MODELS.items():
        mlp = (2 if m.is_gated_mlp else 1) * m.intermediate_size
        if (m.hidden_size, m.num_q_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (
            shape["hidden"],
            shape["q_heads"],
            shape["kv_heads"],
            shape["head_dim"],
            shape["vocab"],
        ) and mlp == 2 * shape["intermediate"]:
            return name
    return None
