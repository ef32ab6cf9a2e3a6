"""Vidur's profiling CSVs, reduced to the medians the fit uses.

Owns: the bundled copy (`preempt/profiles/vidur/`, MIT, see its README) and the reader
that turns it into measured points. `extract()` rebuilds the bundle from the upstream
files (`python -m preempt.calibrate.vidur SRC_DIR`): one long-format CSV per file, the
per-operator medians only (Vidur's time_stats.<op>.median, milliseconds per layer).
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import NamedTuple

# upstream file -> (gpu, model key in preempt.core.profiles.MODELS)
OPERATOR_FILES = {
    "h100_meta-llama_Llama-2-7b-hf.csv": ("h100", "llama2-7b"),
    "h100_meta-llama_Llama-2-70b-hf.csv": ("h100", "llama2-70b"),
    "a100_meta-llama_Meta-Llama-3-8B.csv": ("a100", "llama3-8b"),
    "a100_meta-llama_Meta-Llama-3-70B.csv": ("a100", "llama3-70b"),
    "a100_meta-llama_Llama-2-7b-hf.csv": ("a100", "llama2-7b"),
}
OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
ALL_REDUCE_FILES = {"h100_dgx_all_reduce.csv": "h100", "a100_dgx_all_reduce.csv": "a100"}
ATTENTION_FILE = "a100_attention_old.csv"  # Llama-70B shape (64 q / 8 kv heads) over 2 GPUs


class OpPoint(NamedTuple):
    gpu: str
    model: str
    tp: int
    op: str
    num_tokens: int
    measured_s: float


class AttnPoint(NamedTuple):
    gpu: str
    num_q_heads: int  # whole model; the GPU holds num_q_heads / tp
    num_kv_heads: int
    head_dim: int
    tp: int
    is_prefill: bool
    batch_size: int
    kv_cache_size: int  # decode: each sequence's context; prefill: context before the chunk
    prefill_chunk_size: int
    measured_s: float

    @property
    def sum_attn_ctx(self) -> int:
        if self.is_prefill:  # causal: token i of the chunk sees kv + i + 1 keys
            c = self.prefill_chunk_size
            return c * self.kv_cache_size + c * (c + 1) // 2
        return self.batch_size * self.kv_cache_size

    @property
    def prefill_rows(self) -> int:
        """New tokens beyond each sequence's first: a chunk's other rows (decode: none)."""
        return self.prefill_chunk_size - 1 if self.is_prefill else 0

    @property
    def sum_masked_ctx(self) -> int:
        """Key-query pairs inside the chunk that causal masking removes."""
        c = self.prefill_chunk_size if self.is_prefill else 0
        return c * (c - 1) // 2

    @property
    def sum_kv_read(self) -> int:
        if self.is_prefill:
            return self.kv_cache_size + self.prefill_chunk_size
        return self.batch_size * self.kv_cache_size


class AllReducePoint(NamedTuple):
    gpu: str
    num_gpus: int
    num_bytes: int
    measured_s: float


def _folder() -> Path:
    return Path(str(resources.files("preempt").joinpath("profiles", "vidur")))


def _rows(name: str) -> list[dict[str, str]]:
    with open(_folder() / name, newline="") as f:
        return list(csv.DictReader(f))


def load_ops() -> list[OpPoint]:
    return [
        OpPoint(r["gpu"], r["model"], int(r["tp"]), op, int(r["num_tokens"]), float(r[op]) / 1e3)
        for r in _rows("operators.csv")
        for op in OPS
        if r[op]
    ]


def load_attention() -> list[AttnPoint]:
    return [
        AttnPoint(
            r["gpu"],
            int(r["n_q_head"]),
            int(r["n_kv_head"]),
            int(r["head_dim"]),
            int(r["tp"]),
            r["is_prefill"] == "True",
            int(r["batch_size"]),
            int(r["kv_cache_size"]),
            int(r["prefill_chunk_size"]),
            float(r["median_ms"]) / 1e3,
        )
        for r in _rows("attention.csv")
    ]


def load_all_reduce() -> list[AllReducePoint]:
    return [
        AllReducePoint(r["gpu"], int(r["num_gpus"]), int(r["size"]), float(r["median_ms"]) / 1e3)
        for r in _rows("all_reduce.csv")
    ]


# ------------------------------------------------------------------------- extract
def extract(src: Path, out: Path) -> None:
    """Rebuild the bundle from Vidur's upstream CSVs in `src` (names as in the README)."""
    out.mkdir(parents=True, exist_ok=True)
    grouped: dict[tuple, list[float]] = defaultdict(list)
    for name, (gpu, model) in OPERATOR_FILES.items():
        with open(src / name, newline="") as f:
            for r in csv.DictReader(f):
                key = (gpu, model, int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))
                for op in OPS:
                    value = r[f"time_stats.{op}.median"]
                    if value:
                        grouped[(*key, op)].append(float(value))
    shapes = sorted({key[:4] for key in grouped})
    with open(out / "operators.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "model", "tp", "num_tokens", *OPS])  # per-op median, ms per layer
        for shape in shapes:  # repeated profiles of one shape: their mean
            values = [grouped.get((*shape, op)) for op in OPS]
            w.writerow([*shape, *(f"{sum(v) / len(v):.6g}" if v else "" for v in values)])

    with open(src / ATTENTION_FILE, newline="") as f, open(out / "attention.csv", "w", newline="") as g:
        w = csv.writer(g)
        w.writerow(
            [
                "gpu",
                "n_q_head",
                "n_kv_head",
                "head_dim",
                "tp",
                "is_prefill",
                "batch_size",
                "kv_cache_size",
                "prefill_chunk_size",
                "median_ms",
            ]
        )
        for r in csv.DictReader(f):
            prefill = r["is_prefill"] == "True"
            value = r["time_stats.attn_prefill.median" if prefill else "time_stats.attn_decode.median"]
            head_dim = int(r["n_embd"]) // int(r["n_q_head"])
            w.writerow(
                [
                    "a100",
                    r["n_q_head"],
                    r["n_kv_head"],
                    head_dim,
                    r["num_tensor_parallel_workers"],
                    prefill,
                    r["batch_size"],
                    r["kv_cache_size"],
                    r["prefill_chunk_size"],
                    value,
                ]
            )

    with open(out / "all_reduce.csv", "w", newline="") as g:
        w = csv.writer(g)
        w.writerow(["gpu", "num_gpus", "size", "median_ms"])
        for name, gpu in ALL_REDUCE_FILES.items():
            with open(src / name, newline="") as f:
                for r in csv.DictReader(f):
                    if r["devices_per_node"] == r["num_workers"]:  # one node: NVLink only
                        w.writerow([gpu, r["num_workers"], r["size"], r["time_stats.all_reduce.median"]])


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m preempt.calibrate.vidur SRC_DIR [OUT_DIR]")
    extract(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else _folder())
