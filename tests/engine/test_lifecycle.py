"""The engine's lifecycle: `close()` frees its memory (the host pool's buffer, the KV cache,
the model, the saver's threads), and an engine that is dropped without `close()` is freed
by reference counting alone: no reference cycle needs the cyclic GC, so engines built in a
loop (a sweep, a notebook) do not pile up host pools until a collection happens."""

from __future__ import annotations

import gc
import threading
import time
import types
import weakref
from contextlib import contextmanager

import pytest

from preempt.core.config import PreemptionConfig
from preempt.core.sizes import parse_size
from preempt.engine.engine import Engine
from preempt.kv.host_pool import HostPool, HostPoolError
from tests.conftest import make_request, small_config

# Each tiny-backend engine with a saver maps a host pool of the default size (4 GB of
# address space): one leaked pool is plain in VmData.
DEFAULT_HOST_MEM = parse_size(PreemptionConfig().host_mem)
MiB = 1 << 20

# The main configurations: both backends, every preemption mode, early saves and the
# prefetch, both clocks. Few blocks, so that a few steps already preempt.
CONFIGS = {
    "tiny-recompute": {},
    "tiny-swap": {"preemption": {"mode": "swap"}},
    "tiny-swap_zstd-wall-rule": {
        "preemption": {"mode": "swap_zstd"},
        "clock": {"kind": "wall"},
        "early_save": {"policy": "rule"},
    },
    "tiny-swap_mixed": {"preemption": {"mode": "swap_mixed", "codecs": {"mixed": {"plan": "fp8"}}}},
    "tiny-pause": {"preemption": {"mode": "pause"}},
    "null-swap-lookahead-prefetch": {
        "model": {"backend": "null"},
        "preemption": {"mode": "swap"},
        "early_save": {"policy": "lookahead", "prefetch": True},
    },
    "null-swap_zstd-wall": {
        "model": {"backend": "null"},
        "preemption": {"mode": "swap_zstd"},
        "clock": {"kind": "wall"},
    },
}


def _engine(name: str) -> Engine:
    sections = {"cache": {"num_blocks": 16}, "scheduler": {"reserve_full_sequence": False}}
    for section, values in CONFIGS[name].items():
        sections[section] = {**sections.get(section, {}), **values}
    return Engine(small_config(**sections))


def _step_a_little(engine: Engine, num_steps: int = 6) -> None:
    """A tiny workload: six requests, more than the blocks hold, a few steps."""
    for i in range(6):
        engine.add_request(make_request(i, 14, 12))
    for _ in range(num_steps):
        engine.step()


def _memory() -> dict[str, int]:
    """This process's VmData (mapped data, the host pools' address space) and VmRSS, bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmData", "VmRSS"):
                values[key] = int(value.split()[0]) * 1024  # kB
    return values


@contextmanager
def _gc_disabled():
    """Only reference counting frees anything inside (the cyclic GC is off)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _our_cyclic_garbage() -> list[str]:
    """Run the cyclic GC and name what it found of this project's (its objects, functions,
    futures). Other libraries' cycles (the Triton interpreter's) are not the engine's."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    found = []
    for obj in gc.garbage:
        module = type(obj).__module__
        if isinstance(obj, types.FunctionType):
            module = obj.__module__ or ""
        if module.startswith(("preempt", "concurrent.futures")):
            found.append(f"{module}.{type(obj).__qualname__}")
    gc.garbage.clear()
    return found


def _saver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("kv-saver", "kv-early"))]


def test_close_frees_the_host_pool_kv_cache_and_model():
    engine = _engine("tiny-swap")
    pool, kv_cache = engine.saver.host_pool, engine.runner.kv_cache
    assert pool.allocated_bytes == pool.capacity_bytes == DEFAULT_HOST_MEM
    _step_a_little(engine)
    assert engine.scheduler.num_preemptions > 0  # the pool was written
    before = _memory()["VmData"]
    engine.close()
    assert engine.closed
    assert pool.allocated_bytes == 0 and kv_cache.kv.numel() == 0
    assert engine.runner.model is None
    assert before - _memory()["VmData"] >= DEFAULT_HOST_MEM  # the mapping is gone, not cached
    # The results stay readable (replay writes its summary after closing).
    assert engine.stats()["num_preemptions"] == engine.scheduler.num_preemptions
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    with pytest.raises(HostPoolError, match="closed"):
        pool.reserve(64)


def test_a_closed_host_pool_refuses_data_but_keeps_its_books():
    pool = HostPool("1MB", "64KB", pin_memory=False)
    handle = pool.store(b"kv" * 100)
    pool.close()
    pool.close()
    assert pool.allocated_bytes == 0
    for use in (lambda: pool.store(b"x"), lambda: pool.load(handle), lambda: pool.reserve(8)):
        with pytest.raises(HostPoolError, match="closed"):
            use()
    pool.free(handle)  # an abort after close still releases its slot: only accounting
    assert pool.bytes_used == 0 and pool.peak_bytes_used == 200


def test_close_twice_is_fine_and_stops_the_saver_threads():
    engine = _engine("tiny-swap_zstd-wall-rule")
    _step_a_little(engine)
    assert _saver_threads()  # the saves ran on the workers
    engine.close()
    engine.close()
    assert not _saver_threads()
    assert engine.saver.host_pool.allocated_bytes == 0


def test_with_block_closes():
    with _engine("tiny-swap") as engine:
        _step_a_little(engine, 2)
        pool = engine.saver.host_pool
        assert pool.allocated_bytes == DEFAULT_HOST_MEM
    assert engine.closed and pool.allocated_bytes == 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dropped_engine_is_freed_by_refcount_alone(name):
    _engine(name).close()  # first-use imports (torch among them) happen outside the check
    with _gc_disabled():
        engine = _engine(name)
        _step_a_little(engine)
        refs = [weakref.ref(engine)]
        if engine.saver is not None:
            refs.append(weakref.ref(engine.saver.host_pool._buffer))
        if hasattr(engine.runner, "kv_cache"):
            refs += [weakref.ref(engine.runner.kv_cache.kv), weakref.ref(engine.runner.model)]
        del engine
        # On the wall clock a save still running on a worker holds what it copies until it
        # ends (it was handed its own references): wait for it, gc still off.
        deadline = time.monotonic() + 10
        while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(ref() is None for ref in refs)
        assert _our_cyclic_garbage() == []  # and nothing of it was left in a cycle
    # An unclosed wall-clock engine's workers exit once their executors are freed.
    for thread in _saver_threads():
        thread.join(timeout=10)
    assert not _saver_threads()


def test_two_hundred_engines_keep_memory_bounded():
    """200 engines built and closed in one process (a few steps in every tenth), with the
    cyclic GC off: VmData and RSS stay within 2x of the process with one engine, and VmData
    less than one host pool above where it was after the first engine closed."""
    names = sorted(CONFIGS)
    for name in names:  # first-use imports and allocator warm-up
        with _engine(name) as engine:
            _step_a_little(engine)
    with _engine("tiny-swap") as engine:
        one_engine = _memory()  # one engine open: its host pool is mapped
    baseline = _memory()
    with _gc_disabled():
        for i in range(200):
            with _engine(names[i % len(names)]) as engine:
                if i % 10 == 0:
                    _step_a_little(engine)
        after = _memory()
    print(f"one engine: {one_engine}, after closing it: {baseline}, after 200: {after}")
    for key in ("VmData", "VmRSS"):
        assert after[key] <= 2 * one_engine[key], key
    assert after["VmData"] - baseline["VmData"] < DEFAULT_HOST_MEM // 2  # not one pool leaked
    assert after["VmRSS"] - baseline["VmRSS"] < 256 * MiB
