"""The lz4 codec (preempt/kv/lz4.py): bit-exact round trips of every bit pattern, blobs
within the host store's bound, corrupt blobs refused, and the codec used by
name through the engine (`swap_lz4`) and the vLLM connector's store."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from preempt.kv.codec import CorruptBlobError, decode_blob, make_codec, read_header
from preempt.kv.lz4 import Lz4Codec
from tests.conftest import make_request, small_config
from tests.kv.test_codec import FLOAT_DTYPES, SHAPES, kv_like, random_bits, same_bits


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.uint8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(shuffle, dtype, shape):
    kv = random_bits(shape, dtype)
    codec = make_codec("lz4", shuffle=shuffle)
    blob = codec.encode(kv)
    assert same_bits(codec.decode(blob), kv)
    assert same_bits(decode_blob(blob), kv)  # any reader finds the codec by the blob's id
    decoded = codec.decode(blob)
    if decoded.numel():
        decoded.view(torch.uint8).reshape(-1)[0] ^= 1  # writable, and not a view of the blob
        assert same_bits(codec.decode(blob), kv)


def test_blobs_stay_within_the_stores_bound_and_repeats_compress():
    from preempt.kv.store import blob_bound

    # LZ4 has no entropy coder: random-normal FP16 KV barely compresses (the blob is the
    # raw bytes plus LZ4's literal framing, within the bound the host store reserves) ...
    kv = kv_like((4, 2, 256, 4, 64), torch.float16)
    assert len(Lz4Codec().encode(kv)) <= blob_bound(kv.nbytes)
    # ... while repeats (a last block's unused, zeroed slots) do.
    kv[:, :, 128:] = 0
    assert len(Lz4Codec().encode(kv)) < 0.6 * kv.nbytes


def test_corrupt_blobs_are_refused():
    kv = kv_like((2, 2, 40, 2, 16), torch.bfloat16)
    codec = Lz4Codec()
    blob = codec.encode(kv)
    header = read_header(blob)
    flipped = bytearray(blob)
    flipped[header.header_nbytes + 3] ^= 0x10
    with pytest.raises(CorruptBlobError, match="payload checksum mismatch"):
        codec.decode(flipped)
    # A self-consistent header that claims half the tokens: the payload does not fit it.
    lie = bytearray(blob)
    struct.pack_into("<Q", lie, 32 + 2 * 8, 20)
    struct.pack_into("<Q", lie, 12, kv.nbytes // 2)
    struct.pack_into("<I", lie, header.header_nbytes - 4, zlib.crc32(lie[: header.header_nbytes - 4]))
    with pytest.raises(CorruptBlobError, match="lz4 payload does not decompress"):
        codec.decode(lie)
    with pytest.raises(CorruptBlobError, match="codec mismatch"):
        make_codec("zstd").decode(blob)
    with pytest.raises(ValueError, match="acceleration"):
        Lz4Codec(acceleration=0)


def test_the_engine_saves_and_restores_with_lz4_bit_for_bit():
    from preempt.engine.engine import Engine

    engine = Engine(small_config(preemption={"mode": "swap_lz4"}))
    request = make_request(0, 37, 50)
    engine.add_request(request)
    for _ in range(5):
        engine.step()
    saver, kv_cache, pool = engine.saver, engine.runner.kv_cache, engine.block_pool
    blocks = -(-request.num_computed_tokens // engine.block_size)
    before = kv_cache.read_blocks(request.block_ids[:blocks]).clone()
    saved = saver.save(request, "lz4", 0.0)
    assert saved.failure is None and 0 < saved.bytes_stored.result()
    old = request.block_ids
    kv_cache.kv[:, :, old] = float("nan")
    pool.free(old)
    request.block_ids = pool.allocate(len(old))
    assert saver.restore(request, 0.0).ok
    assert torch.equal(kv_cache.read_blocks(request.block_ids[:blocks]), before)
    assert saver.host_pool.num_used_slots == 0


def test_the_connector_stores_with_lz4():
    from preempt.integrations.vllm.kv_store import (
        PagedKV,
        host_copies,
        make_store_codec,
        parse_connector_settings,
    )

    caches = [torch.randn(10, 2, 32, 2 * 64).to(torch.bfloat16) for _ in range(3)]
    paged = PagedKV(caches, 10, 32, 2, 64)
    settings = parse_connector_settings({"codec": "lz4", "host_pool": "8MiB", "slot_size": "1MiB"})
    assert settings.lossless
    copies = host_copies(settings, make_store_codec(settings, 3, 2), pin_memory=False)
    before = paged.gather([0, 1], 0, 64)
    copies.save("r", paged, [0, 1], 0, 64)
    copies.load("r", paged, [4, 5], 0, 64)
    assert torch.equal(paged.gather([4, 5], 0, 64), before)
    copies.close()
