"""Codecs: bit-exact round trips, compression of KV-like data, and every kind of corrupt blob."""

from __future__ import annotations

import struct
import threading
import zlib

import numpy as np
import pytest
import torch

from preempt.kv.codec import (
    CODECS,
    MAGIC,
    Codec,
    CorruptBlobError,
    MixedCodec,
    RawCodec,
    ZstdCodec,
    byte_shuffle,
    byte_unshuffle,
    decode_blob,
    make_codec,
    pack_header,
    read_header,
)
from preempt.kv.host_pool import HostPool

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# (num_layers, 2, num_tokens, num_kv_heads, head_dim), incl. an empty tokens dim and odd sizes
SHAPES = [(2, 2, 0, 3, 5), (1, 2, 1, 1, 1), (3, 2, 7, 3, 5), (2, 2, 33, 2, 8)]
CODEC_CONFIGS = [
    ("raw", {}),
    ("zstd", {"shuffle": False}),
    ("zstd", {"shuffle": True}),
    ("zstd", {"shuffle": True, "threads": 2, "level": 1}),
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern, NaN payloads, infinities, -0.0 and subnormals included."""
    numel = int(np.prod(shape, dtype=np.int64))
    data = np.random.default_rng(seed).integers(0, 256, numel * dtype.itemsize, dtype=np.uint8)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(shape)


def kv_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Smooth KV-like values: normal per token, a different scale per KV head."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = shape[3]
    scale = torch.rand(num_heads, generator=generator) * 4 + 0.1
    return (torch.randn(shape, generator=generator) * scale[:, None]).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


@pytest.mark.parametrize(("name", "options"), CODEC_CONFIGS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lossless_round_trip_is_bit_exact(name, options, dtype, shape):
    codec = make_codec(name, **options)
    assert codec.is_lossless
    for kv in (random_bits(shape, dtype), kv_like(shape, dtype)):
        blob = codec.encode(kv)
        assert isinstance(blob, bytes)
        decoded = codec.decode(blob)
        assert same_bits(decoded, kv)
        assert kv.numel() == 0 or decoded.data_ptr() != kv.data_ptr()
        header = read_header(blob)
        assert header.shape == shape and header.dtype == dtype and header.raw_nbytes == kv.nbytes


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_one_byte_dtypes_round_trip(dtype):
    kv = random_bits((2, 2, 9, 2, 4), dtype)
    for name in (n for n, cls in CODECS.items() if cls.is_lossless):
        assert same_bits(make_codec(name).decode(make_codec(name).encode(kv)), kv)


def test_scalar_non_contiguous_and_pool_views_round_trip():
    codec = ZstdCodec()
    scalar = torch.tensor(1.5, dtype=torch.bfloat16)
    assert same_bits(codec.decode(codec.encode(scalar)), scalar)
    strided = kv_like((2, 2, 8, 4, 6), torch.float16).transpose(2, 3)
    assert same_bits(codec.decode(codec.encode(strided)), strided.contiguous())
    # decode straight from a host-pool slot view, then free the slot: the tensor must not alias it
    pool = HostPool(1 << 16, 1 << 15, pin_memory=False)
    kv = kv_like((2, 2, 16, 2, 8), torch.float16)
    for codec in (RawCodec(), ZstdCodec()):
        handle = pool.store(codec.encode(kv))
        decoded = codec.decode(pool.load(handle))
        assert same_bits(decoded, codec.decode(pool.load_tensor(handle).numpy()))
        pool.free(handle)
        overwrite = pool.store(b"\xff" * (1 << 15))  # first fit: reuses the freed extent
        assert overwrite.offset == handle.offset
        assert same_bits(decoded, kv)
        pool.free(overwrite)


def test_decoded_tensor_is_writable_and_owned():
    kv = kv_like((1, 2, 4, 2, 4), torch.float32)
    blob = bytearray(RawCodec().encode(kv))
    decoded = RawCodec().decode(blob)
    blob[:] = b"\0" * len(blob)
    decoded += 1  # writable
    assert torch.equal(decoded, kv + 1)


def test_shuffle_helpers_invert():
    data = np.random.default_rng(1).integers(0, 256, 6 * 4, dtype=np.uint8)
    planes = byte_shuffle(data, 4)
    assert list(planes[:6]) == list(data[0::4])  # byte 0 of every element first
    for itemsize in (1, 2, 3, 4, 8):
        data = np.random.default_rng(itemsize).integers(0, 256, 24 * itemsize, dtype=np.uint8)
        assert np.array_equal(byte_unshuffle(byte_shuffle(data, itemsize), itemsize), data)


def test_zstd_shuffle_compresses_kv_like_fp16_better():
    kv = kv_like((2, 2, 512, 8, 64), torch.float16)  # 2 MiB
    plain = len(ZstdCodec(shuffle=False).encode(kv))
    shuffled = len(ZstdCodec(shuffle=True).encode(kv))
    assert kv.nbytes / plain > 1.03
    assert kv.nbytes / shuffled > kv.nbytes / plain + 0.04  # measured ~1.07x vs ~1.15x
    assert len(RawCodec().encode(kv)) < kv.nbytes + 128


def test_any_zstd_instance_decodes_any_zstd_blob():
    kv = kv_like((1, 2, 30, 2, 16), torch.bfloat16)
    blobs = [
        ZstdCodec(level=level, shuffle=shuffle, threads=threads).encode(kv)
        for level in (1, 9)
        for shuffle in (False, True)
        for threads in (0, 2)
    ]
    for blob in blobs:
        assert same_bits(ZstdCodec().decode(blob), kv)
        assert same_bits(decode_blob(blob), kv)
    assert same_bits(decode_blob(RawCodec().encode(kv)), kv)


def test_codec_shared_across_threads():
    codec = ZstdCodec()
    tensors = [kv_like((2, 2, 64, 2, 32), torch.float16, seed=i) for i in range(8)]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for _ in range(5):
                for kv in tensors[offset::2]:
                    assert same_bits(codec.decode(codec.encode(kv)), kv)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_registry_and_options():
    assert set(CODECS) >= {"raw", "zstd"}
    assert len({cls.codec_id for cls in CODECS.values()}) == len(CODECS)
    assert isinstance(make_codec("raw"), RawCodec)
    codec = make_codec("zstd", level=5, threads=2, shuffle=False)
    assert isinstance(codec, Codec) and (codec.level, codec.threads, codec.shuffle) == (5, 2, False)
    with pytest.raises(ValueError, match="unknown codec 'gzip'.*fp8, lz4, mixed, raw, zstd"):
        make_codec("gzip")
    with pytest.raises(ValueError, match="bad options"):
        make_codec("raw", level=3)
    with pytest.raises(ValueError, match="threads"):
        ZstdCodec(threads=-1)
    with pytest.raises(ValueError, match="level"):
        ZstdCodec(level=99)


def test_encode_rejects_unsupported_input():
    with pytest.raises(ValueError, match="dtype"):
        RawCodec().encode(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError):
        RawCodec().encode(np.zeros(3))  # type: ignore[arg-type]


# ---- corruption ---------------------------------------------------------------------------------


def blob_for(codec: Codec) -> bytes:
    return codec.encode(kv_like((2, 2, 40, 2, 16), torch.float16))


def mixed_plan():
    from preempt.kernels.plan import HeadPlan

    return HeadPlan.from_codes([[0, 1], [2, 1]])  # FP16, FP8 / DROP, FP8 for blob_for's shape


@pytest.fixture(params=["raw", "zstd", "lz4", "mixed", "mixed_zstd"])
def codec(request) -> Codec:
    if request.param.startswith("mixed"):
        return make_codec("mixed", plan=mixed_plan(), zstd=request.param.endswith("zstd"))
    return make_codec(request.param)


def test_the_blob_crc_is_zlibs_crc32_whichever_library_computes_it():
    # isal's CRC-32 (when installed) must give zlib's values, running values included, or
    # blobs written on one machine would fail their checksum on another.
    from preempt.kv import codec as codec_module

    try:
        import isal  # noqa: F401  (a dependency; absent only on a bare box, where zlib computes it)
    except ImportError:
        assert codec_module.crc32 is zlib.crc32
    else:
        assert codec_module.crc32 is not zlib.crc32
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    view = memoryview(data)
    assert codec_module.crc32(view) == zlib.crc32(view)
    assert codec_module.crc32(view[7:], 12345) == zlib.crc32(view[7:], 12345)
    assert codec_module.crc32(b"") == 0
    blob = RawCodec().encode(torch.arange(1000, dtype=torch.float16))
    header = read_header(blob)
    assert header.payload_crc == zlib.crc32(memoryview(blob)[header.header_nbytes :])


def test_flipped_payload_byte(codec):
    blob = bytearray(blob_for(codec))
    header = read_header(blob)
    for position in (header.header_nbytes, len(blob) // 2, len(blob) - 1):
        corrupt = bytearray(blob)
        corrupt[position] ^= 0x10
        with pytest.raises(CorruptBlobError, match="payload checksum mismatch"):
            codec.decode(corrupt)


def test_every_flipped_header_byte_is_caught(codec):
    blob = blob_for(codec)
    header_nbytes = read_header(blob).header_nbytes
    for position in range(header_nbytes):
        corrupt = bytearray(blob)
        corrupt[position] ^= 0x01
        with pytest.raises(CorruptBlobError):
            codec.decode(corrupt)
    corrupt = bytearray(blob)
    corrupt[32] ^= 0x01  # first dims byte: the header CRC catches it, no wrong shape
    with pytest.raises(CorruptBlobError, match="header checksum mismatch"):
        codec.decode(corrupt)


def test_truncated_blob(codec):
    blob = blob_for(codec)
    header_nbytes = read_header(blob).header_nbytes
    with pytest.raises(CorruptBlobError, match="truncated blob: payload has"):
        codec.decode(blob[:-1])
    with pytest.raises(CorruptBlobError, match="truncated blob.*header needs"):
        codec.decode(blob[: header_nbytes - 1])
    with pytest.raises(CorruptBlobError, match="truncated blob"):
        codec.decode(blob[:10])
    with pytest.raises(CorruptBlobError, match="truncated blob"):
        codec.decode(b"")
    with pytest.raises(CorruptBlobError, match="length mismatch"):
        codec.decode(blob + b"\0")


def test_wrong_magic(codec):
    blob = bytearray(blob_for(codec))
    blob[:4] = b"PKV2"
    with pytest.raises(CorruptBlobError, match="bad magic"):
        codec.decode(blob)
    with pytest.raises(CorruptBlobError, match="bad magic"):
        codec.decode(b"\x28\xb5\x2f\xfd" + bytes(100))  # a bare zstd frame is not a blob


def test_wrong_version(codec):
    blob = bytearray(blob_for(codec))
    struct.pack_into("<H", blob, 4, 2)
    with pytest.raises(CorruptBlobError, match="unknown blob version 2"):
        codec.decode(blob)


def rewrite_header(blob: bytes, **fields) -> bytearray:
    """Change header fields and recompute the header CRC: a well-formed header that lies."""
    out = bytearray(blob)
    offsets = {"codec_id": (6, "<B"), "dtype_code": (7, "<B"), "flags": (8, "<B"), "raw_nbytes": (12, "<Q")}
    for name, value in fields.items():
        offset, fmt = offsets[name]
        struct.pack_into(fmt, out, offset, value)
    header_nbytes = read_header(blob).header_nbytes
    struct.pack_into("<I", out, header_nbytes - 4, zlib.crc32(out[: header_nbytes - 4]))
    return out


def test_shape_length_mismatch(codec):
    blob = blob_for(codec)
    with pytest.raises(CorruptBlobError, match="shape/length mismatch"):
        codec.decode(rewrite_header(blob, raw_nbytes=read_header(blob).raw_nbytes + 2))
    with pytest.raises(CorruptBlobError, match="shape/length mismatch"):
        codec.decode(rewrite_header(blob, dtype_code=3))  # float32 needs twice the bytes


@pytest.mark.parametrize(
    "codec",
    [RawCodec(), ZstdCodec(), MixedCodec(mixed_plan()), MixedCodec(mixed_plan(), zstd=True)],
    ids=["raw", "zstd", "mixed", "mixed_zstd"],
)
def test_consistent_header_that_lies_about_payload(codec):
    kv = kv_like((2, 2, 40, 2, 16), torch.float16)
    blob = codec.encode(kv)
    # Claim a shape half the size: the header is self-consistent, the payload is not.
    out = bytearray(blob)
    struct.pack_into("<Q", out, 32 + 2 * 8, 20)  # tokens dim 40 -> 20
    struct.pack_into("<Q", out, 12, kv.nbytes // 2)
    header_nbytes = read_header(blob).header_nbytes
    struct.pack_into("<I", out, header_nbytes - 4, zlib.crc32(out[: header_nbytes - 4]))
    with pytest.raises(CorruptBlobError, match="shape/length mismatch"):
        codec.decode(out)
    with pytest.raises(CorruptBlobError, match="unknown flags"):
        codec.decode(rewrite_header(blob, flags=0x80))


def test_codec_mismatch_and_unknown_fields():
    blob = RawCodec().encode(kv_like((1, 2, 3, 2, 4), torch.float32))
    with pytest.raises(CorruptBlobError, match="codec mismatch.*'raw'.*'zstd'"):
        ZstdCodec().decode(blob)
    with pytest.raises(CorruptBlobError, match="unknown dtype code 99"):
        RawCodec().decode(rewrite_header(blob, dtype_code=99))
    with pytest.raises(CorruptBlobError, match="unknown codec id 42"):
        decode_blob(rewrite_header(blob, codec_id=42))
    assert MAGIC == blob[:4]


@pytest.mark.parametrize("name", ["raw", "zstd"])
def test_encode_parts_stored_in_pool_equal_encode(name):
    codec = make_codec(name)
    kv = kv_like((2, 2, 24, 2, 8), torch.bfloat16)
    pool = HostPool(1 << 16, 1 << 14, pin_memory=False)
    parts = codec.encode_parts(kv)
    assert isinstance(parts[0], bytes)
    handle = pool.store(parts)
    assert bytes(pool.load(handle)) == codec.encode(kv)
    assert same_bits(codec.decode(pool.load(handle)), kv)


# ---- mixed precision (swap_mixed) ------------------------------------------------------------


@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mixed_packs_and_unpacks_the_quantized_kv_bit_exactly(zstd, dtype):
    from preempt.kernels.plan import HeadPlan
    from preempt.kernels.quantize_heads import quantize_heads

    kv = kv_like((3, 2, 29, 4, 8), dtype)
    plan = HeadPlan.random(3, 4, fp8_share=0.5, drop_share=0.25, seed=1)
    codec = MixedCodec(plan, zstd=zstd)
    quantized = quantize_heads(kv, plan)
    blob = b"".join(bytes(memoryview(p)) for p in codec.encode_quantized(quantized))
    assert blob == codec.encode(kv)
    back = MixedCodec().decode_quantized(blob)  # any instance: the plan travels in the blob
    assert back.plan.classes == plan.classes and back.num_tokens == 29 and back.dtype == dtype
    for name in ("kept", "fp8", "scales"):
        assert same_bits(getattr(back, name), getattr(quantized, name)), name
    # Size: kept heads at the dtype's width, FP8 heads at one byte, dropped heads nothing.
    expected = 29 * 2 * 8 * (plan.num_fp16 * dtype.itemsize + plan.num_fp8)
    if not zstd:
        assert read_header(blob).payload_nbytes == 12 + 8 * plan.num_fp8 + expected
    assert decode_blob(blob).shape == kv.shape


def test_mixed_with_every_head_kept_is_lossless():
    from preempt.kernels.plan import HeadPlan

    kv = random_bits((2, 2, 13, 3, 4), torch.float16)
    codec = MixedCodec(HeadPlan.all_fp16(2, 3), zstd=True)
    assert same_bits(codec.decode(codec.encode(kv)), kv)


def test_mixed_payload_with_a_bad_plan_or_length_is_refused():
    codec = MixedCodec(mixed_plan())
    blob = codec.encode(kv_like((2, 2, 40, 2, 16), torch.float16))
    header = read_header(blob)
    payload = bytearray(blob[header.header_nbytes :])

    def reblob(new_payload: bytes) -> bytes:  # a valid header and CRC over a lying payload
        return pack_header(2, 0, header.dtype, header.shape, new_payload) + new_payload

    bad_plan = bytearray(payload)
    bad_plan[0] = 42  # no head class 42
    with pytest.raises(CorruptBlobError, match="bad head plan.*unknown head class code 42"):
        codec.decode(reblob(bytes(bad_plan)))
    other_plan = bytearray(payload)
    other_plan[0] = 1  # FP16 -> FP8: every section size changes
    with pytest.raises(CorruptBlobError, match="shape/length mismatch: mixed payload"):
        codec.decode(reblob(bytes(other_plan)))
    with pytest.raises(CorruptBlobError, match="shape/length mismatch: mixed payload"):
        codec.decode(reblob(bytes(payload[:-1])))
    with pytest.raises(ValueError, match="needs a head plan"):
        MixedCodec().encode(kv_like((2, 2, 4, 2, 16), torch.float16))


def test_mixed_zstd_payload_is_bounded_by_the_header():
    """A zstd frame claiming far more than the header's shape allows is refused without
    inflating it (never a huge allocation from a blob)."""
    import zstandard

    from preempt.kv.codec import FLAG_ZSTD

    payload = zstandard.ZstdCompressor(level=3).compress(bytes(8 << 20))  # 8 MiB of zeros
    blob = pack_header(MixedCodec.codec_id, FLAG_ZSTD, torch.float16, (1, 2, 1, 1, 8), payload) + payload
    with pytest.raises(CorruptBlobError, match="mixed zstd payload exceeds"):
        MixedCodec().decode_quantized(blob)


@pytest.mark.parametrize("zstd", [False, True])
def test_mixed_newer_classes_round_trip_and_refuse_corruption(zstd):
    from preempt.kernels.plan import HeadPlan
    from preempt.kernels.restore_blocks import dequantize_heads_ref

    kv = kv_like((2, 2, 41, 5, 16), torch.bfloat16)
    plan = HeadPlan.from_codes(np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]), params=(16, 2, 4))
    codec = MixedCodec(plan, zstd=zstd)
    blob = codec.encode(kv)
    back = MixedCodec().decode_quantized(blob)  # plan and KIVI params travel in the blob
    assert back.plan == plan and back.plan.params() == (16, 2, 4)
    assert torch.equal(MixedCodec().decode(blob), dequantize_heads_ref(back))
    assert torch.equal(decode_blob(blob)[0, :, :, 0], kv[0, :, :, 0])  # the FP16 head is exact
    with pytest.raises(CorruptBlobError):
        MixedCodec().decode(blob[:-1])


def test_mixed_legacy_plans_still_write_the_original_layout():
    from preempt.kernels.plan import HeadPlan
    from preempt.kv.codec import FLAG_FORMATS

    kv = kv_like((2, 2, 9, 3, 8), torch.float16)
    legacy = MixedCodec(HeadPlan.random(2, 3, fp8_share=0.5, drop_share=0.2, seed=0)).encode(kv)
    assert read_header(legacy).flags == 0
    newer = MixedCodec(HeadPlan.from_codes(np.full((2, 3), 4))).encode(kv)
    assert read_header(newer).flags == FLAG_FORMATS
