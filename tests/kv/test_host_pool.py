"""HostPool: sizes, round trips, blobs stored by their own size (not whole slots), OOM reasons and
messages, exact accounting with mixed blob sizes (property test, also across threads)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preempt.kv.host_pool import (
    ALIGN,
    BlobHandle,
    HostPool,
    HostPoolError,
    PreemptionHandlerOOM,
    format_size,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 * 10**9),
        ("256MB", 256 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1024", 1024),
        (1024, 1024),
        (0, 0),
        (" 4 gb ", 4 * 10**9),
        ("128mb", 128 * 10**6),
        ("2KiB", 2048),
        ("3kb", 3000),
        ("10B", 10),
        ("1.1GB", 1_100_000_000),
        ("4G", 4 * 10**9),
        (".5KiB", 512),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GB", "4XB", "-1GB", "4 G B", "1.5B", "0.1", "abc", "4GBs", -5, True, 1.5, None]
)
def test_parse_size_rejects_bad_input(text):
    with pytest.raises(ValueError, match="invalid size") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_format_size():
    assert format_size(4 * 10**9) == "4.0 GB"
    assert format_size(256 * 10**6) == "256 MB"
    assert format_size(512) == "512 B"
    assert format_size(512 * 2**20, binary=True) == "512 MiB"
    assert format_size(parse_size("12.5MB")) == "12.5 MB"


def test_construction():
    pool = HostPool("1000B", "300B", pin_memory=False)
    assert pool.capacity_bytes == 960  # rounded down to ALIGN (64)
    assert pool.num_slots == 3 and pool.num_free_slots == 3  # largest blobs (320 B extents)
    assert pool.allocated_bytes == 960 and pool.bytes_free == 960
    assert not pool.is_pinned
    with pytest.raises(ValueError, match="--preemption-host-mem.*--preemption-slot-size"):
        HostPool(100, 200, pin_memory=False)
    with pytest.raises(ValueError, match="--preemption-slot-size"):
        HostPool(100, 0, pin_memory=False)


def test_pin_memory_true_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="needs CUDA"):
        HostPool(1024, 512, pin_memory=True)


def test_store_load_free_round_trip_all_input_kinds():
    pool = HostPool(4 * 64, 64, pin_memory=False)
    data = bytes(range(50))
    inputs = [
        data,
        bytearray(data),
        memoryview(data),
        np.frombuffer(data, np.uint8),
        torch.frombuffer(bytearray(data), dtype=torch.uint8),
    ]
    handles = [pool.store(blob) for blob in inputs[:4]]
    assert pool.bytes_used == 4 * 50 and pool.bytes_reserved == 4 * 64
    for handle in handles:
        view = pool.load(handle)
        assert view.nbytes == 50 and bytes(view) == data
        assert view.readonly
        assert bytes(pool.load_tensor(handle).numpy()) == data
    assert len({h.offset for h in handles}) == 4
    for handle in handles:
        pool.free(handle)
    handle = pool.store(inputs[4])
    assert bytes(pool.load(handle)) == data
    pool.free(handle)
    assert pool.bytes_used == 0 and pool.num_free_slots == 4 and pool.peak_bytes_used == 200
    pool.check()


def test_empty_blob_and_exact_largest_fit():
    pool = HostPool(2 * ALIGN, ALIGN, pin_memory=False)
    empty = pool.store(b"")
    full = pool.store(b"x" * ALIGN)
    assert bytes(pool.load(empty)) == b"" and bytes(pool.load(full)) == b"x" * ALIGN
    assert not pool.can_store(0)
    pool.check()


def test_small_saves_take_their_size_not_a_slot():
    """The issue's case: a 960 MB pool with 64 MB slots said pool_full at 2.8 MB used (15
    saves of 0.19 MB each took 15 slots). By size, 4,000 such saves fit, with room for a largest blob."""
    pool = HostPool("960MB", "64MB", allocate=False)
    assert pool.num_slots == 15
    handles = [pool.reserve(190_000) for _ in range(4000)]
    assert pool.bytes_used == 4000 * 190_000 and pool.num_used_slots == 4000
    assert pool.bytes_reserved == 4000 * -(-190_000 // ALIGN) * ALIGN
    assert pool.can_store(64 * 10**6)  # a largest blob still fits beside them
    for handle in handles:
        pool.free(handle)
    assert pool.bytes_used == 0 and pool.largest_free_extent == pool.capacity_bytes
    pool.check()


def test_pool_full_raises_and_holds_nothing():
    pool = HostPool(10 * ALIGN, 4 * ALIGN, pin_memory=False)
    handles = [pool.store(b"a" * 100) for _ in range(5)]  # 5 extents of 128 B: 640 B
    assert pool.can_store(100) is False
    with pytest.raises(PreemptionHandlerOOM) as info:
        pool.store(b"b" * 100)
    assert info.value.reason == "pool_full"
    message = str(info.value)
    assert "raise --preemption-host-mem" in message and "500 B in 5 blobs" in message
    assert pool.bytes_used == 500 and pool.num_used_slots == 5
    pool.check()
    pool.free(handles[3])
    assert pool.can_store(100)
    pool.store(b"c" * 100)
    pool.check()


def test_freed_neighbours_coalesce_into_a_largest_blob():
    pool = HostPool(4 * ALIGN, 4 * ALIGN, pin_memory=False)
    handles = [pool.store(b"x" * ALIGN) for _ in range(4)]
    assert not pool.can_store(2 * ALIGN)
    pool.free(handles[1])
    pool.free(handles[3])
    assert not pool.can_store(2 * ALIGN)  # two free extents, not adjacent
    pool.free(handles[2])  # joins both neighbours
    assert pool.largest_free_extent == 3 * ALIGN and pool.can_store(3 * ALIGN)
    pool.check()


def test_oversize_blob_raises_blob_too_large_first():
    pool = HostPool(256 * 10**3, 256 * 10**3, pin_memory=False)
    pool.store(b"x" * 255_000)  # pool nearly full: the size check must still win
    with pytest.raises(PreemptionHandlerOOM) as info:
        pool.store(np.zeros(300 * 10**3, np.uint8))
    assert info.value.reason == "blob_too_large"
    assert info.value.nbytes == 300 * 10**3
    assert "raise --preemption-slot-size (blob 300 KB > 256 KB)" in str(info.value)
    assert pool.bytes_used == 255_000
    assert not pool.can_store(256 * 10**3 + 1)
    pool.check()


def test_double_free_and_stale_handles_raise():
    pool = HostPool(2 * ALIGN, ALIGN, pin_memory=False)
    handle = pool.store(b"abc")
    pool.free(handle)
    with pytest.raises(HostPoolError, match="double free"):
        pool.free(handle)
    with pytest.raises(HostPoolError):
        pool.load(handle)
    reused = pool.store(b"defg")  # first fit: same offset, new generation
    assert reused.offset == handle.offset
    with pytest.raises(HostPoolError, match="stale"):
        pool.load(handle)
    with pytest.raises(HostPoolError):
        pool.free(BlobHandle(offset=7 * ALIGN, nbytes=1, extent=ALIGN, generation=1))
    assert bytes(pool.load(reused)) == b"defg"
    pool.check()


def test_store_rejects_wrong_dtypes():
    pool = HostPool(2 * ALIGN, ALIGN, pin_memory=False)
    with pytest.raises(TypeError, match="uint8"):
        pool.store(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="uint8"):
        pool.store(np.zeros(2, np.float32))
    with pytest.raises(TypeError):
        pool.store("text")  # type: ignore[arg-type]
    assert pool.num_used_slots == 0 and pool.bytes_reserved == 0
    pool.check()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 700), st.integers(0, 1000)), max_size=80))
def test_accounting_exact_with_mixed_blob_sizes(ops):
    """Random stores (0..700 B; the largest allowed is 600) and frees: the data reads back,
    bytes_used and bytes_reserved are exact sums, a store is refused as pool_full only when
    no free extent can hold it, and check() holds after every operation."""
    pool = HostPool(16 * ALIGN, 600, pin_memory=False)
    live: dict[BlobHandle, bytes] = {}
    peak = 0
    for is_store, nbytes, pick in ops:
        if is_store:
            blob = bytes([nbytes % 251]) * nbytes
            extent = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
            fits = pool.largest_free_extent >= extent
            if nbytes > 600:
                with pytest.raises(PreemptionHandlerOOM, match="slot-size"):
                    pool.store(blob)
            elif not fits:
                with pytest.raises(PreemptionHandlerOOM, match="host-mem"):
                    pool.store(blob)
            else:
                handle = pool.store(blob)
                assert handle.extent == extent
                live[handle] = blob
        elif live:
            handle = list(live)[pick % len(live)]
            assert bytes(pool.load(handle)) == live.pop(handle)
            pool.free(handle)
        peak = max(peak, sum(map(len, live.values())))
        assert pool.bytes_used == sum(map(len, live.values()))
        assert pool.bytes_reserved == sum(h.extent for h in live)
        assert pool.bytes_free == pool.capacity_bytes - pool.bytes_reserved
        assert pool.num_used_slots == len(live)
        assert pool.peak_bytes_used == peak
        pool.check()
    for handle, blob in live.items():
        assert bytes(pool.load(handle)) == blob


def test_concurrent_store_and_free_keep_accounting_exact():
    """A save worker stores while the engine thread frees: nothing lost, nothing corrupted."""
    pool = HostPool(8 * 4096, 4096, pin_memory=False)  # blobs of 1..4096 B, mixed
    stored: list[tuple[BlobHandle, int]] = []
    cond = threading.Condition()
    num_blobs = 2000
    errors: list[BaseException] = []
    num_full = 0

    def saver() -> None:
        nonlocal num_full
        try:
            for i in range(num_blobs):
                blob = np.full(1 + (i * 37) % 4096, i % 256, np.uint8)
                while True:
                    try:
                        handle = pool.store(blob)
                        break
                    except PreemptionHandlerOOM:
                        num_full += 1
                        with cond:
                            cond.wait(0.001)
                with cond:
                    stored.append((handle, i))
                    cond.notify_all()
        except BaseException as exc:  # surfaced by the main thread's assert
            errors.append(exc)

    def engine() -> None:
        try:
            for _ in range(num_blobs):
                with cond:
                    while not stored:
                        cond.wait()
                    handle, i = stored.pop(0)
                view = pool.load(handle)
                assert view.nbytes == 1 + (i * 37) % 4096
                assert np.all(np.frombuffer(view, np.uint8) == i % 256)
                pool.free(handle)
                with cond:
                    cond.notify_all()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saver), threading.Thread(target=engine)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    assert pool.bytes_used == 0 and pool.num_free_slots == pool.num_slots
    assert 0 < pool.peak_bytes_used <= 8 * 4096
    pool.check()


def test_store_parts_back_to_back():
    pool = HostPool(2 * ALIGN, 20, pin_memory=False)
    parts = [b"head", np.arange(5, dtype=np.uint8), torch.tensor([9, 8], dtype=torch.uint8), memoryview(b"")]
    handle = pool.store(parts)
    assert handle.nbytes == 11 and pool.bytes_used == 11
    assert bytes(pool.load(handle)) == b"head" + bytes(range(5)) + bytes([9, 8])
    with pytest.raises(PreemptionHandlerOOM, match="slot-size") as info:
        pool.store([b"x" * 15, b"y" * 6])  # each part fits, the blob does not
    assert info.value.nbytes == 21
    assert pool.num_used_slots == 1
    pool.check()


def test_store_into_a_reservation_shrinks_it_to_the_blob():
    """A save decided now and encoded later: an extent is reserved for an upper bound, then
    filled; accounting ends at the blob's real size (the tail freed), and an oversized blob
    releases it."""
    pool = HostPool(4096, 1024, pin_memory=False)
    reservation = pool.reserve(1000)
    assert pool.bytes_used == 1000 and pool.bytes_reserved == 1024
    handle = pool.store(b"x" * 600, into=reservation)
    assert handle.offset == reservation.offset and handle.nbytes == 600 and pool.bytes_used == 600
    assert pool.bytes_reserved == 640 and bytes(pool.load(handle)) == b"x" * 600
    pool.check()
    pool.free(handle)
    too_small = pool.reserve(100)
    with pytest.raises(PreemptionHandlerOOM, match="exceeds its reservation") as err:
        pool.store(b"y" * 101, into=too_small)
    assert err.value.reason == "blob_too_large"
    assert pool.num_free_slots == 4 and pool.bytes_used == 0  # nothing leaked
    with pytest.raises(HostPoolError, match="already freed"):
        pool.store(b"z", into=too_small)
    pool.check()
