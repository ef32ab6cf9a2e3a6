"""Step durations and KV capacity of a named deployment target, for the virtual clock.

Owns: the hardware/model constants of each target (with their sources) and the roofline
that turns a step's shape into seconds. Plain Python. It never runs anything: the tiny
model on a laptop computes real tokens while this says how long an H200 serving
Llama-3-8B would have taken for the same step.

Roofline of one step (all tokens of the batch in one forward pass):
    compute_s = (2 * P * T + 4 * L * Dq * sum_ctx) / (peak_flops * compute_eff)
    memory_s  = (weight_bytes + kv_bytes_per_token * sum_ctx_read) / (hbm_bw * memory_eff)
    step_s    = max(compute_s, memory_s) + step_overhead_s
with P non-embedding parameters, T tokens in the step, L layers, Dq = query heads x
head_dim, sum_ctx the attention context summed over the step's tokens, sum_ctx_read the
KV tokens read (each sequence's context once per step). Multi-GPU targets use tensor
parallelism: aggregate FLOP/s and bandwidth, times a TP efficiency for the all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

GB = 1e9


@dataclass(frozen=True)
class TargetProfile:
    name: str
    # --- model (Llama-3 family, from the models' config.json on the HF hub) ---
    num_params: float  # non-embedding parameters (embeddings are a lookup, not a GEMM)
    weight_bytes: float  # all weights, bf16
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    # --- hardware ---
    num_gpus: int
    gpu_mem_bytes: float  # per GPU
    hbm_bytes_per_s: float  # per GPU
    peak_flops: float  # per GPU, dense bf16, *measured* (not the datasheet)
    pcie_bytes_per_s: float  # per GPU, device<->pinned host, one direction, in practice
    # --- efficiencies and reserves (stated assumptions, tune per deployment) ---
    compute_eff: float = 0.6  # large-GEMM MFU of a tuned engine
    memory_eff: float = 0.8  # achievable fraction of HBM bandwidth in decode
    tp_eff: float = 1.0  # tensor-parallel all-reduce tax (1.0 on one GPU)
    gpu_mem_util: float = 0.9  # vLLM's default gpu_memory_utilization
    activation_reserve_bytes: float = 2 * GB  # per GPU, activations + CUDA graphs
    step_overhead_s: float = 1e-3  # scheduler + launch overhead per step (vLLM V1, ~1 ms)
    sources: str = ""

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (whole model, all GPUs together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @cached_property
    def kv_capacity_tokens(self) -> int:
        usable = self.num_gpus * (self.gpu_mem_bytes * self.gpu_mem_util - self.activation_reserve_bytes)
        return int((usable - self.weight_bytes) // self.kv_bytes_per_token)


_H200 = dict(
    gpu_mem_bytes=141 * GB,  # NVIDIA H200 datasheet: 141 GB HBM3e
    hbm_bytes_per_s=4.8e12,  # NVIDIA H200 datasheet: 4.8 TB/s
    peak_flops=790e12,  # SPEC.md "Physical limits": bf16 ~790 TFLOP/s measured (989 datasheet)
    pcie_bytes_per_s=55 * GB,  # SPEC.md: PCIe Gen5 x16 ~55 GB/s per direction in practice
)

TARGETS: dict[str, TargetProfile] = {
    "h200-llama3-8b": TargetProfile(
        name="h200-llama3-8b",
        # meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV
        # heads, intermediate 14336, vocab 128256 -> 8.03B params, 7.50B without embeddings.
        num_params=7.50e9,
        weight_bytes=8.03e9 * 2,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype_bytes=2,
        num_gpus=1,
        **_H200,
        sources="Llama-3-8B config.json; NVIDIA H200 datasheet; SPEC.md physical limits",
    ),
    "4xh200-llama3-70b": TargetProfile(
        name="4xh200-llama3-70b",
        # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV
        # heads, intermediate 28672, vocab 128256 -> 70.6B params, 69.5B without embeddings.
        num_params=69.5e9,
        weight_bytes=70.6e9 * 2,
        num_layers=80,
        num_q_heads=64,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype_bytes=2,
        num_gpus=4,
        tp_eff=0.85,  # assumption: TP=4 all-reduces over NVLink cost ~15% of step time
        **_H200,
        sources="Llama-3-70B config.json; NVIDIA H200 datasheet; SPEC.md physical limits",
    ),
}


def get_target(name: str) -> TargetProfile:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown clock.target '{name}'; choose one of {sorted(TARGETS)}") from None


class StepShape(NamedTuple):
    """What a step computes, in the units the roofline needs."""

    num_tokens: int  # new tokens in the batch (prefill chunks + decodes)
    sum_attn_ctx: int  # sum over new tokens of the context each attends to
    sum_kv_read: int  # KV tokens read: each scheduled sequence's context once


class CostModel:
    def __init__(self, target: TargetProfile) -> None:
        self.target = target
        t = target
        self._flops_per_s = t.num_gpus * t.peak_flops * t.compute_eff * t.tp_eff
        self._bytes_per_s = t.num_gpus * t.hbm_bytes_per_s * t.memory_eff * t.tp_eff
        self._attn_flops_per_ctx = 4 * t.num_layers * t.num_q_heads * t.head_dim

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        t = self.target
        flops = 2 * t.num_params * shape.num_tokens + self._attn_flops_per_ctx * shape.sum_attn_ctx
        nbytes = t.weight_bytes + t.kv_bytes_per_token * shape.sum_kv_read
        return max(flops / self._flops_per_s, nbytes / self._bytes_per_s) + t.step_overhead_s

    def kv_capacity_blocks(self, block_size: int) -> int:
        return self.target.kv_capacity_tokens // block_size

    def pcie_time_s(self, num_bytes: float) -> float:
        """Device<->host copy time of a request's KV (all GPUs copy their shard at once)."""
        return num_bytes / (self.target.num_gpus * self.target.pcie_bytes_per_s)

    def hbm_pass_time_s(self, num_bytes: float) -> float:
        """A memory-bound kernel that reads and writes `num_bytes` in all (e.g. the save
        path's gather + quantize: raw in, packed out), at the step's HBM efficiency."""
        return num_bytes / self._bytes_per_s
