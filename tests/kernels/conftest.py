"""Kernel tests: the interpreter on CPU, compiled kernels on CUDA.

The root conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA before anything
imports triton; on a CUDA machine it is left unset, so the `gpu` tests run compiled
kernels and the interpreter tests skip. `preempt.kernels.dispatch.launchable` also re-makes a
kernel (and its helpers) compiled before the variable was set, so a run that sets it late
works too (tests/kernels/test_dispatch.py).
"""

from __future__ import annotations

import pytest
import torch

from preempt.kernels.dispatch import interpreter_enabled


@pytest.fixture
def interp() -> torch.device:
    """The CPU device, for Triton kernels under the interpreter (skip when it is off)."""
    if not interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is not set: interpreter tests run on CPU-only machines")
    return torch.device("cpu")


@pytest.fixture
def cuda() -> torch.device:
    """A CUDA device for compiled kernels (skip without one, or under the interpreter)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is set: gpu tests want compiled kernels")
    return torch.device("cuda")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparisons (NaN payloads, -0.0 included)."""
    return tensor.contiguous().view(torch.uint8)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(bits(actual.cpu()), bits(expected.cpu())), "tensors differ in at least one bit"


def random_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(L, 2, N, bs, H, D) values spread over many binades (1e-4 .. 1e2 by channel), with
    a -0.0 planted, so rounding paths and sign handling are all exercised."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, block_size, num_heads, head_dim)
    spread = torch.logspace(-4, 2, head_dim)
    cache = (torch.randn(shape, generator=gen) * spread).to(dtype)
    cache[0, 0, 0, 0, 0, 0] = -0.0
    return cache.to(device)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that takes the `cuda` fixture is a `gpu` test, marked or not, so that
    `pytest -m gpu` (the GPU machine's run, scripts/gpu_check.sh) selects all of them."""
    for item in items:
        if "cuda" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
