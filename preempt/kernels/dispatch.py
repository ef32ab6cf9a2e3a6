"""Which implementation runs a kernel call, and how tensors are handed to Triton.

Owns: the choice between a Triton kernel and its torch `*_ref` (`use_triton`), getting a
launchable kernel on CPU under Triton's interpreter (`launchable`), and the integer views
that the kernels move data through (`storage_view`). It never decides what to save.

The rule (`use_triton(device, requested)`):
- requested=None (the default): Triton on CUDA, the torch reference on CPU (the
  interpreter is ~0.5 s a call: never a production path).
- requested=True: Triton; on CPU only when TRITON_INTERPRET=1 is set (tests), otherwise
  a RuntimeError that says so.
- requested=False: the torch reference, anywhere.

Why integer views: kernels copy kept heads as raw bits (bit-exact whatever the dtype,
NaN payloads and -0.0 included) and do every float conversion they need with explicit
bit arithmetic, because Triton's interpreter gets two conversions wrong (measured with
triton 3.7.1): fp32 -> float8e4nv (~2.5% of values that should round up to the next
power of two come out halved) and fp32 -> bfloat16 (about half the values wrong).
Integers and fp16 it handles exactly, like the hardware.
"""

from __future__ import annotations

import os
import types

import torch
import triton
import triton.language as tl

# dtype -> (kind code the kernels branch on, integer dtype with the same bits)
DTYPE_KINDS: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float16: (0, torch.int16),
    torch.bfloat16: (1, torch.int16),
    torch.float32: (2, torch.int32),
    torch.float64: (3, torch.int64),
}
KV_DTYPES = tuple(DTYPE_KINDS)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, 1.0 where amax is 0: the FP8 scales, divided as the kernels divide (IEEE,
    `div_rn`) on every device. Not `amax / 448.0`: CUDA torch turns a division by a Python
    scalar into a multiplication by its reciprocal, one ulp off for most values (measured on
    an H200: 17-23 of 32 scales differed; docs/gpu.md)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(device: torch.device, requested: bool | None = None) -> bool:
    """True: launch the Triton kernel; False: run the torch reference (see module doc)."""
    if requested is False:
        return False
    if device.type == "cuda":
        return True
    if requested is None:
        return False
    if not interpreter_enabled():
        raise RuntimeError(
            f"Triton kernels on {device.type} need Triton's interpreter: set TRITON_INTERPRET=1 "
            "(or call with use_triton=None/False for the torch reference)"
        )
    return True


_INTERPRETED: dict[int, object] = {}


def launchable(kernel: object, device: torch.device) -> object:
    """The kernel, ready to launch on `device`. Triton decides compiled vs interpreted when
    a `@triton.jit` function is defined, so a kernel imported before TRITON_INTERPRET=1 was
    set is re-made here for the interpreter, with every `@triton.jit` helper it reaches
    re-made too (ours and triton.language's own, such as `tl.zeros`): CPU runs do not
    depend on import order. The modules themselves are left as they are."""
    if device.type == "cuda" or not isinstance(kernel, triton.runtime.JITFunction):
        return kernel
    wrapped = _INTERPRETED.get(id(kernel))
    if wrapped is None:
        wrapped = _interpreted(kernel, {})
        _INTERPRETED[id(kernel)] = wrapped
    return wrapped


# What a twin must still see for the interpreter to patch triton.language's builtins while
# it runs (`_patch_lang` looks for the real modules among the function's globals).
_LANGUAGE = {"_interpreter_tl": tl, "_interpreter_tl_core": tl.core}
_TWINNED_PACKAGES = (f"{__package__}.", "triton.language")


def _interpreted(jit_fn: triton.runtime.JITFunction, memo: dict[int, object]) -> object:
    """An interpreter twin of `jit_fn`: its Python function over a copy of its module's
    globals in which `@triton.jit` functions, and modules holding them, are twins too
    (`memo`: id -> twin, so shared helpers, and recursion, resolve to one twin)."""
    from triton.runtime.interpreter import InterpretedFunction

    twin = memo.get(id(jit_fn))
    if twin is None:
        fn = jit_fn.fn
        twin_fn = types.FunctionType(
            fn.__code__, _twin_globals(fn.__globals__, memo), fn.__name__, fn.__defaults__, fn.__closure__
        )
        twin_fn.__kwdefaults__ = fn.__kwdefaults__
        twin = memo[id(jit_fn)] = InterpretedFunction(twin_fn)
    return twin


def _twin_globals(namespace: dict[str, object], memo: dict[int, object]) -> dict[str, object]:
    twin = memo.get(id(namespace))
    if twin is None:
        twin = memo[id(namespace)] = dict(namespace)  # stored first: helpers of this module find it
        twin.update(_LANGUAGE)
        for name, value in namespace.items():
            if isinstance(value, triton.runtime.JITFunction):
                twin[name] = _interpreted(value, memo)
            elif isinstance(value, types.ModuleType) and value.__name__.startswith(_TWINNED_PACKAGES):
                twin[name] = _twin_module(value, memo)
    return twin  # type: ignore[return-value]


def _twin_module(module: types.ModuleType, memo: dict[int, object]) -> types.ModuleType:
    """A stand-in for `module` whose `@triton.jit` functions are twins; every other name
    is looked up on the module itself when used (so the interpreter's patches apply)."""
    twin = memo.get(id(module))
    if twin is None:
        twin = memo[id(module)] = types.ModuleType(module.__name__)
        twin.__getattr__ = lambda name: getattr(module, name)  # PEP 562: names not set here
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction):
                setattr(twin, name, _interpreted(value, memo))
    return twin  # type: ignore[return-value]


def storage_view(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(integer view with the same bits, dtype kind code). Raises on unsupported dtypes."""
    if tensor.dtype not in DTYPE_KINDS:
        names = ", ".join(str(d).removeprefix("torch.") for d in KV_DTYPES)
        raise ValueError(f"KV dtype {tensor.dtype} is not supported by the kernels; supported: {names}")
    kind, int_dtype = DTYPE_KINDS[tensor.dtype]
    return tensor.view(int_dtype), kind


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """A paged cache (L, 2, num_blocks, block_size, H, D) with contiguous (H, D) rows."""
    if kv_cache.ndim != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), "
            f"got shape {tuple(kv_cache.shape)}"
        )
    _check_rows(kv_cache, "kv_cache")


def check_kv(kv: torch.Tensor) -> None:
    """A gathered KV tensor (L, 2, T, H, D) with contiguous (H, D) rows."""
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(
            f"kv must be (num_layers, 2, num_tokens, num_kv_heads, head_dim), got {tuple(kv.shape)}"
        )
    _check_rows(kv, "kv")


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in DTYPE_KINDS:
        storage_view(tensor)  # raises the dtype error
    head_dim = tensor.shape[-1]
    if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
        raise ValueError(
            f"{name}: the (num_kv_heads, head_dim) dims must be contiguous, got strides {tensor.stride()}"
        )


def check_block_ids(block_ids: torch.Tensor, device: torch.device, num_blocks: int, name: str) -> None:
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {block_ids.dtype}")
    if block_ids.device != device:
        raise ValueError(f"{name} is on {block_ids.device}, the cache on {device}")
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise IndexError(f"{name} must lie in [0, {num_blocks})")


@triton.jit
def bits_to_float32(bits, SRC_KIND: tl.constexpr):
    """A cache element's integer bits (a `storage_view`) as float32, inside a kernel:
    SRC_KIND 0 fp16, 1 bf16 (by shifting its bits: the interpreter's bf16 conversion is
    wrong), 2 fp32, 3 fp64. The one copy every kernel that reads cache bits uses."""
    if SRC_KIND == 0:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    elif SRC_KIND == 1:
        x = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif SRC_KIND == 2:
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.float64, bitcast=True).to(tl.float32)
    return x
