"""Which implementation runs: Triton on CUDA, torch on CPU, the interpreter when asked."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from preempt.kernels import dispatch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_default_is_triton_on_cuda_and_torch_on_cpu():
    assert dispatch.use_triton(CUDA) is True
    assert dispatch.use_triton(CPU) is False
    assert dispatch.use_triton(CUDA, False) is False


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(CPU, True) is True
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(CPU, True)


def test_storage_views_keep_bits_and_reject_other_dtypes():
    x = torch.tensor([1.5, -0.0], dtype=torch.bfloat16)
    view, kind = dispatch.storage_view(x)
    assert (view.dtype, kind) == (torch.int16, 1) and view.data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="not supported"):
        dispatch.storage_view(torch.zeros(2, dtype=torch.int8))


def _add_one(x_ptr, n, BLOCK: tl.constexpr):  # a kernel body, jitted below without the decorator
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def test_a_kernel_compiled_before_the_interpreter_was_set_is_rewrapped(interp):
    compiled = triton.runtime.JITFunction(_add_one)  # what a too-early import would have made
    x = torch.zeros(5, dtype=torch.int32)
    dispatch.launchable(compiled, interp)[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1] * 5


def test_every_kernel_works_after_an_import_before_the_interpreter_was_set():
    """The order a user (or another test module) can make, in a fresh process: triton and
    every kernel module imported in compiled mode, TRITON_INTERPRET=1 set only then. The
    kernel tests still pass: the kernels and their `@triton.jit` helpers (ours, reached by
    name and as `dispatch.bits_to_float32`, and triton.language's, such as `tl.zeros`) are
    re-made for the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    package = here.parents[1] / "preempt" / "kernels"
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    script = (
        "import os, sys, pytest\n"
        + "".join(f"import preempt.kernels.{name}\n" for name in modules)
        + "os.environ['TRITON_INTERPRET'] = '1'\n"
        + f"args = ['-q', '-p', 'no:cacheprovider', '{here}', '--ignore', '{here / 'test_dispatch.py'}']\n"
        + "sys.exit(pytest.main(args))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]  # 5: no test ran
