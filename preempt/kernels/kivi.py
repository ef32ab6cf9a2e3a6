"""KIVI-style KV heads (Liu et al. 2024, arXiv 2402.02750), the `KIVI4`, `KIVI2` and
`KIVI_K<k>V<v>` head classes: the public entry, re-exporting what callers import.

Where each part lives:
- preempt/kernels/kivi_ref.py: the format of a packed head (what the bytes mean), the bit packing
  of any width, and the torch references `quantize_kivi_ref` / `dequantize_kivi_ref`;
- preempt/kernels/kivi_triton.py: the five Triton quantize kernels and their wrapper
  `quantize_kivi` (bit-exact against the reference);
- preempt/kernels/kivi_batched.py: the batched CPU path, every KIVI head of a request at once
  (`KiviClass`, `quantize_kivi_kv`, `dequantize_kivi_kv`: the reference's bytes).
None decides the plan (preempt/kernels/plan.py) or writes the cache. File map: docs/kernels.md.
"""

from __future__ import annotations

from preempt.kernels.kivi_batched import KiviClass, dequantize_kivi_kv, quantize_kivi_kv
from preempt.kernels.kivi_ref import (
    HALF_MAX,
    MIN_SCALE,
    ROUNDER,
    Heads,
    dequantize_kivi_ref,
    layout_for,
    quantize_kivi_ref,
)
from preempt.kernels.kivi_triton import quantize_kivi

__all__ = [
    "HALF_MAX",
    "MIN_SCALE",
    "ROUNDER",
    "Heads",
    "KiviClass",
    "dequantize_kivi_kv",
    "dequantize_kivi_ref",
    "layout_for",
    "quantize_kivi",
    "quantize_kivi_kv",
    "quantize_kivi_ref",
]
