"""Step durations, copy times and KV capacity of a deployment target, for the virtual clock.

Owns: the operator-level formula that turns a step's shape into seconds, for a target
of `preempt.core.profiles` (model shape, fitted device constants). Plain Python, no
torch, no numpy. It never runs anything: the tiny model on a laptop computes real tokens while
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
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from typing import NamedTuple

from preempt.core.profiles import ELEMENTWISE_OPS, ProfileError, TargetProfile


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
    def __deepcopy__(self, memo: dict[int, object]) -> CostModel:
        return self  # a function of its target; its memoized terms are valid for every copy

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

    def decode_step_time_s(self, num_seqs: int, context: int) -> float:
        """`step_time_s` of a step in which `num_seqs` sequences decode one token each,
        `context` the sum of their contexts with the new tokens (each attends to and reads
        its whole context once): the same float, the same operations in the same order,
        without building the step's shape and op times (the engine's decode runs price
        every step of a run with it)."""
        terms = self._token_terms.get(num_seqs)
        if terms is None:
            terms = self._token_terms[num_seqs] = self._token_count_terms(num_seqs)
        lm_head = self._lm_head.get(num_seqs)
        if lm_head is None:
            lm_head = self._lm_head[num_seqs] = self._lm_head_s(num_seqs)
        linear, elementwise, all_reduce = terms
        attention = self.target.model.num_layers * self.attention_s(context, context)
        return linear + elementwise + attention + all_reduce + lm_head + self._dev.cpu_step_overhead_s

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
