"""The bundled parity workloads, generated (seeded) so anyone can regenerate them:

    python -m preempt.parity.bundled      # rewrites preempt/parity/workloads/*.json

Each stresses one part of the scheduler; every one makes vLLM preempt, so victim choice,
re-admission and recompute are all compared, not only the easy path.
"""

from __future__ import annotations

import json

import numpy as np

from preempt.core.workload import load_trace
from preempt.parity.workload import BUNDLED_DIR, parse_workload


def _requests(prompts, outputs, arrivals, priorities) -> list[dict]:
    return [
        dict(id=i, prompt_tokens=int(p), output_tokens=int(o), arrival_step=int(a), priority=int(q))
        for i, (p, o, a, q) in enumerate(zip(prompts, outputs, arrivals, priorities, strict=True))
    ]


def _random(seed: int, num: int, prompt: tuple[int, int], output: tuple[int, int], gap: float, levels=(0,)):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt[0], prompt[1] + 1, num)
    outputs = rng.integers(output[0], output[1] + 1, num)
    arrivals = np.floor(np.cumsum(rng.exponential(gap, num)) - gap).clip(0) if gap else np.zeros(num)
    priorities = rng.choice(levels, num)
    return _requests(prompts, outputs, arrivals, priorities)


def _from_trace(trace: str, num: int, step_s: float, max_total: int, start: int = 0) -> list[dict]:
    """The trace's first `num` requests (from row `start`) that fit, arrival times turned
    into steps of `step_s` seconds, priorities 0/1 by a seeded 80/20 mix."""
    rows = [r for r in load_trace(trace)[start:] if r.prompt_tokens + r.output_tokens < max_total][:num]
    base = rows[0].arrival_s
    priorities = np.random.default_rng(0).choice([0, 1], len(rows), p=[0.8, 0.2])
    return _requests(
        [r.prompt_tokens for r in rows],
        [r.output_tokens for r in rows],
        [int((r.arrival_s - base) // step_s) for r in rows],
        priorities,
    )


def bundled_workloads() -> dict[str, dict]:
    return {
        "burst-tight": {
            "description": "40 requests at once into a pool that holds a fraction of them",
            "block_size": 16,
            "num_gpu_blocks": 161,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 512,
            "requests": _random(1, 40, (16, 300), (8, 200), gap=0),
        },
        "staggered": {
            "description": "Poisson arrivals every ~3 steps, moderate memory pressure",
            "block_size": 16,
            "num_gpu_blocks": 121,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 256,
            "requests": _random(2, 80, (10, 400), (10, 160), gap=3.0),
        },
        "priority-mix": {
            "description": "three priority classes arriving together in waves, tight memory",
            "block_size": 16,
            "num_gpu_blocks": 101,
            "max_num_seqs": 24,
            "max_num_batched_tokens": 384,
            "policy": "priority",
            "requests": _random(3, 60, (20, 250), (10, 150), gap=1.5, levels=(0, 1, 2)),
        },
        "long-prompts-chunked": {
            "description": "prompts of 1k-3k tokens prefilled in 256-token chunks; room for ~3",
            "block_size": 16,
            "num_gpu_blocks": 513,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 256,
            "requests": _random(4, 16, (1000, 3000), (20, 120), gap=6.0, levels=(0, 1)),
        },
        "short-prompts-long-outputs": {
            "description": "short prompts, outputs of 300-800 tokens: decode growth runs the pool out",
            "block_size": 16,
            "num_gpu_blocks": 181,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 256,
            "requests": _random(5, 40, (5, 40), (300, 800), gap=2.0, levels=(0, 1)),
        },
        "azure-conv-slice": {
            "description": "the bundled Azure conversation trace's first 200 requests, 25 ms steps",
            "block_size": 16,
            "num_gpu_blocks": 1025,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "max_model_len": 16384,
            "requests": _from_trace("azure-conv", 200, 0.025, 16384),
        },
        "mooncake-slice": {
            "description": "the bundled Mooncake trace's first 60 requests (long prompts), 50 ms steps",
            "block_size": 32,
            "num_gpu_blocks": 641,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 4096,
            "max_model_len": 20480,
            "requests": _from_trace("mooncake-synthetic", 60, 0.05, 20480),
        },
    }


def write_bundled() -> list[str]:
    BUNDLED_DIR.mkdir(exist_ok=True)
    names = []
    for name, data in bundled_workloads().items():
        parse_workload(data, name=name)  # every bundled workload is valid
        (BUNDLED_DIR / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        names.append(name)
    return names


if __name__ == "__main__":
    print("\n".join(write_bundled()))
