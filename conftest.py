"""Loaded by pytest before any test module, and so before any project import.

Triton fixes compiled vs interpreted when a `@triton.jit` function is defined, so the
interpreter setting must be in the environment before the first `import triton` (a test
module importing `preempt.kernels.*` or `preempt.kv`). On a machine without CUDA the kernels can
only run under the interpreter: set it here, where every import sees it, whatever the
order pytest collects in. With CUDA it is left unset, so the `gpu` tests compile.
wandb and `datasets` are kept off the network the same way (a user's setting wins).
"""

from __future__ import annotations

import os

import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
