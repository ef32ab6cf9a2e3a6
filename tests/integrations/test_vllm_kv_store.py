"""The connector's host side (preempt/integrations/vllm/kv_store.py over preempt/kv/store.py)
in preempt's own environment: vLLM's cache layouts seen as preempt's (L, 2, T, H, D), round trips through
the pool bit for bit (raw, zstd) or within FP8's error (fp8, mixed), segments, a full
pool and a corrupt blob refused with the copy freed."""

from __future__ import annotations

import pytest
import torch

from preempt.integrations.vllm.kv_store import (
    ConnectorSettingsError,
    PagedKV,
    host_copies,
    make_store_codec,
    parse_connector_settings,
)
from preempt.kv.codec import CorruptBlobError
from preempt.kv.store import resolve

L, NB, BS, H, D = 3, 10, 32, 2, 64


def cpu_caches(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(NB, H, BS, 2 * D).to(dtype) for _ in range(L)]


def reference(caches, block_ids, num_tokens):
    """(L, 2, T, H, D) read the way vLLM's CPU attention reads its cache."""
    out = []
    for t in caches:
        kv = t.view(NB, H, 2 * BS, D)
        k, v = kv[:, :, :BS], kv[:, :, BS:]
        ks = torch.cat([k[b].permute(1, 0, 2) for b in block_ids])[:num_tokens]
        vs = torch.cat([v[b].permute(1, 0, 2) for b in block_ids])[:num_tokens]
        out.append(torch.stack([ks, vs]))
    return torch.stack(out)


def store(codec="raw", **extra):
    settings = parse_connector_settings({"codec": codec, "host_pool": "8MiB", "slot_size": "1MiB", **extra})
    return host_copies(settings, make_store_codec(settings, L, H), pin_memory=False)


def test_cpu_layout_gathers_what_attention_reads():
    caches = cpu_caches()
    paged = PagedKV(caches, NB, BS, H, D)
    assert torch.equal(paged.gather([4, 1, 7], 0, 96), reference(caches, [4, 1, 7], 96))
    assert torch.equal(paged.gather([4, 1, 7], 32, 64), reference(caches, [4, 1, 7], 96)[:, :, 32:])
    with pytest.raises(ValueError, match="whole blocks"):
        paged.gather([4, 1, 7], 0, 70)


@pytest.mark.parametrize("layout", ["flash", "flashinfer"])
def test_gpu_layouts(layout):
    shape = (2, NB, BS, H, D) if layout == "flash" else (NB, 2, BS, H, D)
    caches = [torch.randn(shape) for _ in range(L)]
    paged = PagedKV(caches, NB, BS, H, D)
    kv = paged.gather([2, 5], 0, 64)
    k0 = caches[0][0] if layout == "flash" else caches[0][:, 0]
    assert torch.equal(kv[0, 0, 33], k0[5, 1])


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="not a layout"):
        PagedKV([torch.zeros(NB, BS, H, D)], NB, BS, H, D)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_lossless_round_trip_into_other_blocks(codec):
    caches = cpu_caches()
    paged = PagedKV(caches, NB, BS, H, D)
    saved = reference(caches, [0, 1, 2], 96)
    kv_store = store(codec)
    kv_store.save("r", paged, [0, 1, 2], 0, 64)
    kv_store.save("r", paged, [0, 1, 2], 64, 96)  # a second segment (an early copy, then the rest)
    kv_store.wait("r")
    assert kv_store.stored("r") == (96, None)
    for t in caches:  # vLLM reuses the blocks
        t.zero_()
    stats = kv_store.load("r", paged, [6, 3, 9], 32, 96)  # the first block came from the prefix cache
    assert stats.num_tokens == 64
    assert torch.equal(reference(caches, [6, 3, 9], 96)[:, :, 32:], saved[:, :, 32:])
    assert kv_store.pool.bytes_used == 0 and "r" not in kv_store.copies


@pytest.mark.parametrize("codec", ["fp8", "mixed"])
def test_lossy_round_trip_within_fp8_error(codec):
    caches = cpu_caches(torch.float32)
    paged = PagedKV(caches, NB, BS, H, D)
    saved = reference(caches, [0, 1], 64)
    kv_store = store(codec)
    kv_store.save("r", paged, [0, 1], 0, 64)
    kv_store.wait("r")
    raw, stored = kv_store.nbytes("r")
    assert stored < raw
    kv_store.load("r", paged, [4, 5], 0, 64)
    got = reference(caches, [4, 5], 64)
    err = (got - saved).abs().max() / saved.abs().max()
    assert 0 < err < 0.07  # E4M3: 3 mantissa bits


def test_mixed_plan_keeps_drop_heads_as_fp8(tmp_path):
    from preempt.kernels.plan import HeadClass, HeadPlan

    plan = HeadPlan.from_codes([[HeadClass.DROP, HeadClass.FP16]] * L)
    plan.save(tmp_path / "plan.json")
    lines = []
    settings = parse_connector_settings({"codec": "mixed", "head_plan": str(tmp_path / "plan.json")})
    codec = make_store_codec(settings, L, H, log=lines.append)
    assert codec.plan.num_drop == 0 and codec.plan.num_fp8 == L
    assert "kept as FP8" in lines[0]


def test_full_pool_and_oversized_copy_fail_the_copy_and_hold_nothing():
    caches = cpu_caches()
    paged = PagedKV(caches, NB, BS, H, D)
    kv_store = store("raw", host_pool="256KiB", slot_size="128KiB")  # a copy of 64 tokens: 96 KiB
    kv_store.save("big", paged, list(range(NB)), 0, 96)
    for request_id in ("a", "b", "c"):
        kv_store.save(request_id, paged, [0, 1], 0, 64)
    for request_id in ("big", "a", "b", "c"):
        kv_store.wait(request_id)
    assert kv_store.stored("big") == (96, "blob_too_large")
    assert [kv_store.stored(r)[1] for r in "abc"] == [None, None, "pool_full"]
    for request_id in ("big", "a", "b", "c"):
        kv_store.discard(request_id)
    assert kv_store.pool.bytes_used == 0
    kv_store.pool.check()


def test_corrupt_blob_is_refused_and_freed():
    caches = cpu_caches()
    paged = PagedKV(caches, NB, BS, H, D)
    kv_store = store("raw")
    kv_store.save("r", paged, [0, 1], 0, 64)
    kv_store.wait("r")
    handle = resolve(kv_store.copies["r"].segments[0].handle)
    kv_store.pool._array[handle.offset + 100] ^= 0xFF
    with pytest.raises(CorruptBlobError):
        kv_store.load("r", paged, [4, 5], 0, 64)
    assert kv_store.pool.bytes_used == 0 and "r" not in kv_store.copies


def test_a_load_on_the_load_thread_reports_through_its_future():
    caches = cpu_caches()
    paged = PagedKV(caches, NB, BS, H, D)
    saved = reference(caches, [0, 1], 64)
    kv_store = store("raw")
    for request_id in ("r", "bad"):
        kv_store.save(request_id, paged, [0, 1], 0, 64)  # still storing: the load waits for it
    kv_store.wait("bad")
    handle = resolve(kv_store.copies["bad"].segments[0].handle)
    kv_store.pool._array[handle.offset + 100] ^= 0xFF
    loaded = kv_store.load_later("r", paged, [4, 5], 0, 64)
    failed = kv_store.load_later("bad", paged, [6, 7], 0, 64)
    assert loaded.result(timeout=30).num_tokens == 64
    assert torch.equal(reference(caches, [4, 5], 64), saved)
    with pytest.raises(CorruptBlobError):
        failed.result(timeout=30)
    assert kv_store.pool.bytes_used == 0 and not kv_store.copies  # both freed, the failed one too
    kv_store.close()


def test_bad_settings_name_the_field():
    with pytest.raises(ConnectorSettingsError, match="codec"):
        parse_connector_settings({"codec": "gzip"})
    with pytest.raises(ConnectorSettingsError, match="host_pool"):
        parse_connector_settings({"host_pool": "lots"})


def test_lossy_requests_never_enter_the_prefix_cache():
    from types import SimpleNamespace

    from preempt.integrations.vllm.kv_store import never_cache

    cached = []
    coordinator = SimpleNamespace(
        cache_blocks=lambda request, num_tokens, **kw: cached.append(request.request_id)
    )
    lossy: set[str] = set()
    never_cache(coordinator, lossy)
    coordinator.cache_blocks(SimpleNamespace(request_id="a"), 64)
    lossy.add("b")  # b loaded a lossy copy (the connector adds it when it reports the tokens)
    coordinator.cache_blocks(SimpleNamespace(request_id="b"), 64, replay_boundaries=())
    coordinator.cache_blocks(SimpleNamespace(request_id="a"), 96)
    assert cached == ["a", "a"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["raw", "fp8", "mixed"])
def test_on_cuda_copies_go_through_the_device_kernels_and_a_pinned_pool(codec):
    # FlashAttention's layout, on the device: mixed/fp8 quantize with the Triton kernel
    caches = [torch.randn(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    paged = PagedKV(caches, NB, BS, H, D)
    settings = parse_connector_settings({"codec": codec, "host_pool": "8MiB", "slot_size": "1MiB"})
    kv_store = host_copies(settings, make_store_codec(settings, L, H))
    assert kv_store.pool.is_pinned
    saved = paged.gather([0, 1], 0, 64).float()
    kv_store.save("r", paged, [0, 1], 0, 64)
    kv_store.wait("r")
    kv_store.load("r", paged, [4, 5], 0, 64)
    got = paged.gather([4, 5], 0, 64).float()
    if codec == "raw":
        assert torch.equal(got, saved)
    else:
        assert (got - saved).abs().max() / saved.abs().max() < 0.07
