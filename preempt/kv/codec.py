"""KV codecs: a request's KV out of a paged cache into a self-describing blob, and back.

Owns: the blob format shared by every codec (a fixed little-endian header, then the payload),
its validation, and the codecs themselves (`raw`, `zstd`, the lossy `mixed` of mode
`swap_mixed`: FP16 / FP8 / drop per KV head by a head plan, and `fp8`: every head FP8).
Their names live in `preempt.core.registry.CODECS`; `CODECS` here is that registry's
classes. A codec is one class with two sides:
- the host side, `encode_parts` / `decode`: a dense CPU tensor (any shape; a request's KV is
  `(num_layers, 2, num_tokens, num_kv_heads, head_dim)` in logical order) <-> one blob;
- the device side, `gather` / `scatter` (over any `PagedCache`: the engine's, or the vLLM
  connector's view of vLLM's) and what it costs on the virtual clock (`device_time`,
  `host_time_s`, `stored_share`). By default a save copies the cache's bytes to the host
  and encodes them there; `mixed` quantizes on the device, fused with the block gather.
A lossless codec of bytes (zstd, lz4) subclasses `ShuffledBytesCodec` and only compresses
and decompresses; its class names its `calibration` on the virtual clock.

It must never: hold state between blobs (every blob decodes on its own, with any instance of
its codec), keep a block table (callers pass one per call), or trust a header it has not
validated (a corrupt blob raises CorruptBlobError, it never yields a wrong tensor or a huge
allocation).

Blob layout (version 1, little-endian):

    offset size field
    0      4    magic b"PKV1"
    4      2    version (u16) = 1
    6      1    codec id (u8): the writing codec's `codec_id` (raw 0, zstd 1, mixed 2, fp8 3, ...)
    7      1    dtype code (u8), see _DTYPES
    8      1    flags (u8), codec-specific (zstd: bit 0 = byte-shuffled)
    9      1    ndim (u8)
    10     2    reserved, zero
    12     8    raw byte length (u64): numel * itemsize of the decoded tensor
    20     8    payload length (u64)
    28     4    CRC32 of the payload (u32)
    32     8*ndim dims (u64 each)
    ..     4    CRC32 of every header byte before it (u32)
    then the payload.

The header has its own CRC so a flipped flag or dtype byte (which would leave the payload CRC
intact and decode into wrong values) is caught too. CRC32 detects every single-byte flip,
which is what the corruption tests rely on. It is zlib's CRC-32, computed by ISA-L
(`isal.isal_zlib.crc32`: the same values, ~8x faster, carry-less multiplication; 5 ms
for a 93 MB KIVI blob here, where zlib's took 40 ms, ~11% of that blob's encode) where
the `isal` package is installed, else by zlib: blobs are the same bytes either way.
"""

from __future__ import annotations

import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import torch
import zstandard

from preempt.core import registry
from preempt.core.config import CodecCalibration

try:  # the same CRC-32 as zlib's, faster (module docstring)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover (isal is a dependency; the GPU check's box may lack it)
    crc32 = zlib.crc32

MAGIC = b"PKV1"
VERSION = 1
_FIXED = struct.Struct("<4sHBBBBxxQQI")  # magic .. payload crc; dims and header crc follow
_DIM = struct.Struct("<Q")
_CRC = struct.Struct("<I")
FLAG_SHUFFLED = 0x01
FLAG_ZSTD = 0x02  # mixed: the packed payload is zstd-compressed (kept section byte-shuffled)
# mixed: the payload starts with the plan's KIVI parameters and may hold the classes after
# DROP (FP8_TOKEN, KIVI4, KIVI2). Blobs without it are the original layout, unchanged; an
# older reader refuses a blob with it as "unknown flags".
FLAG_FORMATS = 0x04
_FORMAT_PARAMS = struct.Struct("<III")  # group_size, num_sink, num_recent

# dtype code -> torch dtype. Codes are part of the format: never renumber, only append.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.float32,
    4: torch.float64,
    5: torch.uint8,
    6: torch.int8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CorruptBlobError(ValueError):
    """A blob that fails validation: bad magic, unknown version, truncated, checksum or
    shape/length mismatch. The message says which."""


class BlobHeader(NamedTuple):
    codec_id: int
    dtype: torch.dtype
    flags: int
    shape: tuple[int, ...]
    raw_nbytes: int
    payload_nbytes: int
    payload_crc: int
    header_nbytes: int


def pack_header(codec_id: int, flags: int, dtype: torch.dtype, shape: tuple[int, ...], payload: Any) -> bytes:
    """The header for `payload` (any bytes-like object, or a list of them that follow one
    another: the CRC runs over the parts, so they need not be joined). For codec authors."""
    parts = payload if isinstance(payload, list) else [payload]
    views = [memoryview(part).cast("B") for part in parts]
    crc = 0
    for view in views:
        crc = crc32(view, crc)
    raw_nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header = bytearray(
        _FIXED.pack(
            MAGIC,
            VERSION,
            codec_id,
            _DTYPE_CODES[dtype],
            flags,
            len(shape),
            raw_nbytes,
            sum(view.nbytes for view in views),
            crc,
        )
    )
    for dim in shape:
        header += _DIM.pack(dim)
    header += _CRC.pack(crc32(header))
    return bytes(header)


def read_header(blob: Any) -> BlobHeader:
    """Parse and validate a blob's header (not its payload). Raises CorruptBlobError."""
    view = _as_byte_view(blob)
    if view.nbytes < len(MAGIC):
        raise CorruptBlobError(f"truncated blob: {view.nbytes} bytes, shorter than the magic")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CorruptBlobError(f"bad magic {bytes(view[: len(MAGIC)])!r}, expected {MAGIC!r}: not a KV blob")
    if view.nbytes < _FIXED.size:
        raise CorruptBlobError(f"truncated blob: {view.nbytes} bytes, header needs at least {_FIXED.size}")
    magic, version, codec_id, dtype_code, flags, ndim, raw_nbytes, payload_nbytes, payload_crc = (
        _FIXED.unpack_from(view)
    )
    if version != VERSION:
        raise CorruptBlobError(f"unknown blob version {version}, this reader knows version {VERSION}")
    header_nbytes = _FIXED.size + ndim * _DIM.size + _CRC.size
    if view.nbytes < header_nbytes:
        raise CorruptBlobError(f"truncated blob: {view.nbytes} bytes, header needs {header_nbytes}")
    (header_crc,) = _CRC.unpack_from(view, header_nbytes - _CRC.size)
    if crc32(view[: header_nbytes - _CRC.size]) != header_crc:
        raise CorruptBlobError("header checksum mismatch: the blob header is corrupt")
    if dtype_code not in _DTYPES:
        raise CorruptBlobError(f"unknown dtype code {dtype_code} in blob header")
    dtype = _DTYPES[dtype_code]
    shape = tuple(_DIM.unpack_from(view, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != raw_nbytes:
        raise CorruptBlobError(
            f"shape/length mismatch: shape {shape} of {dtype} is {numel * dtype.itemsize} bytes, "
            f"header says {raw_nbytes}"
        )
    total = header_nbytes + payload_nbytes
    if view.nbytes < total:
        raise CorruptBlobError(
            f"truncated blob: payload has {view.nbytes - header_nbytes} of {payload_nbytes} bytes"
        )
    if view.nbytes > total:
        raise CorruptBlobError(
            f"blob length mismatch: {view.nbytes} bytes, header and payload account for {total}"
        )
    return BlobHeader(codec_id, dtype, flags, shape, raw_nbytes, payload_nbytes, payload_crc, header_nbytes)


def unpack_blob(blob: Any, codec_id: int) -> tuple[BlobHeader, memoryview]:
    """Validate the whole blob (header, lengths, payload CRC) and return the header and a view of
    the payload (no copy). For codec authors."""
    view = _as_byte_view(blob)
    header = read_header(view)
    if header.codec_id != codec_id:
        names = {cls.codec_id: name for name, cls in CODECS.items()}
        raise CorruptBlobError(
            f"codec mismatch: blob was written by codec {names.get(header.codec_id, header.codec_id)!r}, "
            f"this decoder is {names.get(codec_id, codec_id)!r}"
        )
    payload = view[header.header_nbytes :]
    if crc32(payload) != header.payload_crc:
        raise CorruptBlobError("payload checksum mismatch: the blob payload is corrupt")
    return header, payload


class Codec(ABC):
    """Turns a KV tensor into a blob (`encode`) and back (`decode`).

    Rules every codec keeps:
    - `encode` takes a CPU tensor of a supported dtype (float16, bfloat16, float32, float64; also
      uint8, int8, float8) and any shape, including an empty tokens dim; the blob carries dtype
      and shape, so `decode` needs nothing else.
    - A lossless codec (`is_lossless`) round-trips bit-exactly: every byte, NaN payloads and -0.0
      included. A lossy codec documents what it loses.
    - `decode` validates the whole header and the payload checksum before it trusts a length or
      allocates, and raises CorruptBlobError on anything wrong; the returned tensor owns its
      memory (it never aliases the blob, which may be a host-pool slot about to be freed).
    - Blobs are stateless: any instance of a codec decodes any blob of that codec, whatever its
      options. Instances may be shared across threads.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    is_lossless: ClassVar[bool] = True
    calibration: ClassVar[CodecCalibration] = CodecCalibration(encode_mb_s=0, decode_mb_s=0, modelled_ratio=1)
    """The host side on the virtual clock, measured by `preempt bench save` (the config's
    `clock.codecs.<name>` overrides it): by default free, and storing every byte."""

    @abstractmethod
    def encode_parts(self, kv: torch.Tensor) -> list[bytes | np.ndarray]:
        """The blob as consecutive parts (header first), not yet joined: `HostPool.store` takes
        the list and copies each part straight into the slot. A part may be a view of `kv` (the
        raw codec's payload is), so do not modify `kv` until the parts are stored."""

    def encode(self, kv: torch.Tensor) -> bytes:
        """`kv`: CPU tensor, e.g. (num_layers, 2, num_tokens, num_kv_heads, head_dim) -> one blob."""
        parts = self.encode_parts(kv)
        # bytes.join releases the GIL for large joins only when every part is a bytes object;
        # an array part (the raw payload) is copied with the GIL held (~0.5 ms per MB here).
        return b"".join(part if isinstance(part, bytes) else memoryview(part) for part in parts)

    @abstractmethod
    def decode(self, blob: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
        """The tensor `encode` was given: same dtype and shape, bit-exact if lossless."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ---- the device side: what a save reads out of a paged cache, what a restore writes back.
    # A codec that packs on the device (`mixed`) overrides these; the rest move the cache's
    # own bytes and encode them on the host.

    @classmethod
    def build(cls, options: Mapping[str, Any], num_layers: int, num_kv_heads: int, seed: int = 0) -> Codec:
        """This codec for a model with this many layers and KV heads (a codec that
        quantizes per head sizes its plan by them), from its options."""
        return cls(**options)

    def gather(self, cache: PagedCache, block_ids: Sequence[int], start: int, num_tokens: int) -> Any:
        """Tokens `[start, start + num_tokens)` of the request whose block table is `block_ids`,
        out of `cache` and onto the host, as `encode_gathered` takes them: a copy, so the
        blocks may be reused once this returns."""
        return cache.gather(block_ids, start, num_tokens).to("cpu")

    def encode_gathered(self, gathered: Any) -> list[bytes | np.ndarray]:
        """What `gather` returned -> blob parts (header first)."""
        return self.encode_parts(gathered)

    def decode_gathered(self, blob: bytes | bytearray | memoryview | np.ndarray) -> Any:
        """A blob -> what `scatter` writes (the inverse of `encode_gathered`)."""
        return self.decode(blob)

    def scatter(
        self, decoded: Any, cache: PagedCache, block_ids: Sequence[int], start: int, num_tokens: int
    ) -> np.ndarray | None:
        """Write `decoded` as tokens `[start, start + num_tokens)` of the request whose block
        table is `block_ids`; the heads it could not restore, (L, H) bool, or None for
        none. Raises CorruptBlobError when `decoded` is not KV of that shape."""
        cache.scatter(decoded, block_ids, start, num_tokens)
        return None

    def device_time(self, nbytes: float, cost_model: Any) -> tuple[float, float]:
        """Virtual clock: (device kernel seconds, bytes over PCIe) of moving `nbytes` of the
        deployment's KV through this codec: the raw bytes, no kernel."""
        return 0.0, nbytes

    def host_time_s(self, nbytes: float, mb_s: Mapping[str, float]) -> float:
        """Virtual clock: host seconds to encode (or decode) `nbytes` at the calibrated
        throughputs `mb_s` (codec name -> MB/s; 0 or absent: free)."""
        return _seconds(nbytes, mb_s.get(self.name, 0.0))

    def stored_share(self, modelled_ratio: float) -> float:
        """The share of the raw bytes a blob takes, where no KV data exists to measure it
        (the `null` backend): one over the codec's assumed compression ratio."""
        return 1 / modelled_ratio

    @property
    def loses_precision(self) -> bool:
        """A restore from this codec's blobs is not the saved KV, bit for bit."""
        return not self.is_lossless

    def check_shape(self, num_layers: int, num_kv_heads: int) -> None:  # noqa: B027 (most fit any shape)
        """ValueError unless this instance can save KV of this many layers and KV heads."""


class PagedCache(Protocol):
    """A paged KV cache as a codec's device side reads and writes it: the engine's
    `preempt.kv.kv_cache.KVCache`, the vLLM connector's view of vLLM's cache. A request's
    KV is addressed by its block table and a token range of whole blocks (a range may end
    mid-block only at the request's last block)."""

    def raw_nbytes(self, num_tokens: int) -> int:
        """Bytes `gather` copies for `num_tokens` tokens, as this cache holds them."""
        ...

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """A copy of the tokens' KV (the cache's layout; dense, on its device)."""
        ...

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        """The inverse of `gather`; CorruptBlobError if `kv` does not fit."""
        ...

    def gather_quantized(self, block_ids: Sequence[int], start: int, num_tokens: int, plan: Any) -> Any:
        """The tokens' KV packed by a head plan, on the device (a `QuantizedKV`)."""
        ...

    def scatter_quantized(
        self, quantized: Any, block_ids: Sequence[int], start: int, num_tokens: int
    ) -> np.ndarray | None:
        """Dequantize into the blocks; the dropped heads (L, H), or None for none.
        CorruptBlobError if `quantized` does not fit."""
        ...


class RawCodec(Codec):
    """No compression: the payload is the tensor's bytes. The baseline every codec must beat."""

    name = "raw"
    codec_id = 0

    def encode_parts(self, kv: torch.Tensor) -> list[bytes | np.ndarray]:
        data = tensor_bytes(kv)
        return [pack_header(self.codec_id, 0, kv.dtype, tuple(kv.shape), data), data]

    def decode(self, blob: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
        header, payload = unpack_blob(blob, self.codec_id)
        if header.flags != 0:
            raise CorruptBlobError(f"unknown flags {header.flags:#x} for codec 'raw'")
        if header.payload_nbytes != header.raw_nbytes:
            raise CorruptBlobError(
                f"shape/length mismatch: raw payload is {header.payload_nbytes} bytes, "
                f"shape needs {header.raw_nbytes}"
            )
        out = np.empty(header.raw_nbytes, dtype=np.uint8)
        out[:] = np.frombuffer(payload, dtype=np.uint8)
        return bytes_to_tensor(out, header)


class ShuffledBytesCodec(Codec):
    """A lossless codec of the tensor's bytes, byte-shuffled first when `shuffle` (byte 0 of
    every element, then byte 1, ...; a no-op for 1-byte dtypes; header flag
    FLAG_SHUFFLED): a subclass only compresses and decompresses bytes (zstd, lz4)."""

    shuffle: bool = True

    @abstractmethod
    def compress(self, data: np.ndarray) -> bytes:
        """The payload of `data`, (n,) uint8."""

    @abstractmethod
    def decompress(self, payload: memoryview, raw_nbytes: int) -> np.ndarray:
        """(raw_nbytes,) writable uint8 from a payload whose header was validated;
        CorruptBlobError if it does not decompress to exactly that many bytes."""

    def encode_parts(self, kv: torch.Tensor) -> list[bytes | np.ndarray]:
        data = tensor_bytes(kv)
        itemsize = kv.dtype.itemsize
        is_shuffled = self.shuffle and itemsize > 1
        if is_shuffled:
            data = byte_shuffle(data, itemsize)
        payload = self.compress(data)
        flags = FLAG_SHUFFLED if is_shuffled else 0
        return [pack_header(self.codec_id, flags, kv.dtype, tuple(kv.shape), payload), payload]

    def decode(self, blob: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
        header, payload = unpack_blob(blob, self.codec_id)
        if header.flags & ~FLAG_SHUFFLED:
            raise CorruptBlobError(f"unknown flags {header.flags:#x} for codec '{self.name}'")
        out = self.decompress(payload, header.raw_nbytes)
        if header.flags & FLAG_SHUFFLED:
            out = byte_unshuffle(out, header.dtype.itemsize)
        return bytes_to_tensor(out, header)


class ZstdCodec(ShuffledBytesCodec):
    """zstd over the tensor's bytes, optionally byte-shuffled first.

    `shuffle` groups byte 0 of every element, then byte 1, ... (for fp16/bf16 the sign+exponent
    bytes sit together, and those repeat far more than mantissa bytes): measured on fp16
    KV-like data, ratio ~1.07x plain vs ~1.15-1.18x shuffled, and shuffled data also compresses
    faster. It is a no-op for 1-byte dtypes. `threads` is zstd's own worker count (0 = compress
    on the calling thread); zstd releases the GIL either way.
    """

    name = "zstd"
    codec_id = 1
    # `preempt bench save` on this kind of machine: level 3 + shuffle, one core, 16-bit KV
    calibration = CodecCalibration(encode_mb_s=480, decode_mb_s=1000, modelled_ratio=1.15)

    def __init__(self, level: int = 3, threads: int = 0, shuffle: bool = True) -> None:
        if not isinstance(level, int) or not -(2**17) <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd level must be an int <= {zstandard.MAX_COMPRESSION_LEVEL}, got {level!r}")
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(f"zstd threads must be an int >= 0, got {threads!r}")
        self.level = level
        self.threads = threads
        self.shuffle = bool(shuffle)
        # zstandard's (de)compressor objects are not safe to share between threads, and a save
        # worker and the engine thread may both use one codec: one pair per thread, reused
        # across calls (a context costs a few MB of tables to build).
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ZstdCodec(level={self.level}, threads={self.threads}, shuffle={self.shuffle})"

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
            self._local.compressor = compressor
        return compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor()
            self._local.decompressor = decompressor
        return decompressor

    def compress(self, data: np.ndarray) -> bytes:
        return self._compressor().compress(data)

    def decompress(self, payload: memoryview, raw_nbytes: int) -> np.ndarray:
        # raw_nbytes bounds the output: decompress straight into a buffer of that size (2x
        # faster here than decompress(), which builds a bytes object).
        out = np.empty(raw_nbytes, dtype=np.uint8)
        try:
            reader = self._decompressor().stream_reader(payload, read_across_frames=False)
            filled = _readinto_full(reader, memoryview(out))
            has_extra = reader.read(1) != b""
        except zstandard.ZstdError as exc:
            raise CorruptBlobError(f"zstd payload does not decompress: {exc}") from exc
        if filled != raw_nbytes or has_extra:
            raise CorruptBlobError(
                f"shape/length mismatch: zstd payload decompresses to "
                f"{'more than ' if has_extra else ''}{filled} bytes, shape needs {raw_nbytes}"
            )
        return out


class MixedCodec(Codec):
    """Mixed precision per KV head (docs/design.md §9), lossy: a head plan keeps each (layer, KV head)
    at the cache's dtype (bit-exact), as float8 E4M3 with one scale per (head, K or V), or
    drops it (restored as zeros; attention masks it for the rest of the request).

    The quantization itself runs where the KV lives (`preempt.kernels.quantize_heads`: Triton on
    CUDA, fused with the block gather, before the PCIe copy; the torch reference on CPU);
    this codec only packs a `QuantizedKV` into a blob and back (`encode_quantized`,
    `decode_quantized`). `encode`/`decode` of a dense tensor are there for the Codec
    interface: they quantize with this instance's plan and dequantize (dropped heads 0).

    Payload (after the common header, whose shape/dtype are the dense KV's
    (L, 2, T, H, D)): plan codes (L*H int8), scales (n_fp8*2 float32), kept heads
    (n_fp16, 2, T, D) in the cache dtype, FP8 heads (n_fp8, 2, T, D) as bytes. The plan
    codes fix every section's size, so a payload of any other length is refused. With
    `zstd=True` the payload is zstd-compressed, the kept section byte-shuffled first.

    A plan with the newer classes (FP8_TOKEN, KIVI4, KIVI2: preempt/kernels/plan.py) or non-default
    KIVI parameters sets FLAG_FORMATS: the payload then starts with (group_size, num_sink,
    num_recent) as three u32, and after the FP8 heads come the `QuantizedKV.extra` rows of
    each newer class in code order (sizes from `preempt.kernels.plan.head_bytes`). Legacy plans
    write exactly the old layout.
    """

    name = "mixed"
    codec_id = 2
    is_lossless = False

    def __init__(self, plan: Any = None, zstd: bool = False, level: int = 3) -> None:
        self.plan = plan  # kernels.plan.HeadPlan; only `encode` of a dense tensor needs it
        self.zstd = bool(zstd)
        self._zstd = ZstdCodec(level=level)
        self._ratio: tuple[Any, float] | None = None  # (plan, its size ratio), see size_ratio

    def __repr__(self) -> str:
        return f"MixedCodec(plan={self.plan.source if self.plan else None!r}, zstd={self.zstd})"

    def encode_parts(self, kv: torch.Tensor) -> list[bytes | np.ndarray]:
        from preempt.kernels.quantize_heads import quantize_heads

        if self.plan is None:
            raise ValueError("MixedCodec.encode needs a head plan: MixedCodec(plan=...)")
        return self.encode_quantized(quantize_heads(kv, self.plan))

    def encode_quantized(self, quantized: Any) -> list[bytes | np.ndarray]:
        """A `QuantizedKV` on the CPU -> blob parts (header first)."""
        plan = quantized.plan
        shape = (plan.num_layers, 2, quantized.num_tokens, plan.num_kv_heads, quantized.head_dim)
        kept = tensor_bytes(quantized.kept)
        sections = [
            plan.codes().reshape(-1).view(np.uint8),
            tensor_bytes(quantized.scales),
            byte_shuffle(kept, quantized.dtype.itemsize) if self.zstd else kept,
            tensor_bytes(quantized.fp8),
        ]
        flags = 0
        if not plan.is_legacy:
            flags = FLAG_FORMATS
            params = np.frombuffer(_FORMAT_PARAMS.pack(*plan.params()), dtype=np.uint8)
            sections = [params, *sections, *(tensor_bytes(rows) for rows in quantized.extra)]
        if self.zstd:
            payload: bytes | np.ndarray = self._zstd._compressor().compress(
                b"".join(memoryview(section) for section in sections)
            )
            flags |= FLAG_ZSTD
            return [pack_header(self.codec_id, flags, quantized.dtype, shape, payload), payload]
        # The sections go to the host pool as they are: joining them would copy every byte once more.
        sections = [section for section in sections if section.size]
        return [pack_header(self.codec_id, flags, quantized.dtype, shape, sections), *sections]

    def decode_quantized(self, blob: bytes | bytearray | memoryview | np.ndarray) -> Any:
        """Blob -> `QuantizedKV` on the CPU (the plan comes from the blob). Raises
        CorruptBlobError on any inconsistency."""
        from preempt.kernels.plan import EXTRA_CLASSES, HeadPlan, head_bytes
        from preempt.kernels.quantize_heads import QuantizedKV

        header, payload = unpack_blob(blob, self.codec_id)
        if header.flags & ~(FLAG_ZSTD | FLAG_FORMATS):
            raise CorruptBlobError(f"unknown flags {header.flags:#x} for codec 'mixed'")
        if len(header.shape) != 5 or header.shape[1] != 2:
            raise CorruptBlobError(
                f"shape mismatch: mixed KV must be (L, 2, T, H, D), header says {header.shape}"
            )
        num_layers, _, num_tokens, num_heads, head_dim = header.shape
        num_codes = num_layers * num_heads
        data = np.frombuffer(payload, dtype=np.uint8)
        has_formats = bool(header.flags & FLAG_FORMATS)
        if header.flags & FLAG_ZSTD:
            # Never trust the frame's own size: decompress into a buffer bounded by what the
            # header allows (every head at its largest class), one byte over to see overflow.
            # (a KIVI head is at most its raw bytes plus params; FP8_TOKEN at most 2 T (D + 4))
            largest = header.raw_nbytes // max(1, num_codes) + 2 * num_tokens * (head_dim + 4)
            largest += 8 * (num_tokens + 1) * head_dim
            bound = num_codes + num_codes * 2 * 4 + header.raw_nbytes
            if has_formats:
                bound = _FORMAT_PARAMS.size + num_codes * (1 + 8 + largest)
            out = np.empty(bound + 1, dtype=np.uint8)
            try:
                reader = self._zstd._decompressor().stream_reader(payload, read_across_frames=False)
                filled = _readinto_full(reader, memoryview(out))
            except zstandard.ZstdError as exc:
                raise CorruptBlobError(f"zstd payload does not decompress: {exc}") from exc
            if filled > bound:
                raise CorruptBlobError(f"shape/length mismatch: mixed zstd payload exceeds {bound} bytes")
            data = out[:filled]
        params = None
        if has_formats:
            if data.size < _FORMAT_PARAMS.size:
                raise CorruptBlobError(f"truncated mixed payload: {data.size} bytes, no format parameters")
            params = _FORMAT_PARAMS.unpack(data[: _FORMAT_PARAMS.size].tobytes())
            data = data[_FORMAT_PARAMS.size :]
        if data.size < num_codes:
            raise CorruptBlobError(f"truncated mixed payload: {data.size} bytes, the plan needs {num_codes}")
        try:
            codes = data[:num_codes].view(np.int8).reshape(num_layers, num_heads)
            plan = HeadPlan.from_codes(codes, params=params) if params else HeadPlan.from_codes(codes)
            if not has_formats and not plan.is_legacy:
                raise ValueError("newer head classes in a blob without the formats flag")
            extra_sizes = [
                plan.count(cls) * head_bytes(cls, num_tokens, head_dim, header.dtype.itemsize, plan.params())
                for cls in EXTRA_CLASSES
            ] if has_formats else []  # fmt: skip
        except ValueError as exc:
            raise CorruptBlobError(f"bad head plan in mixed blob: {exc}") from None
        itemsize = header.dtype.itemsize
        row = 2 * num_tokens * head_dim
        sizes = (plan.num_fp8 * 2 * 4, plan.num_fp16 * row * itemsize, plan.num_fp8 * row, *extra_sizes)
        if data.size != num_codes + sum(sizes):
            raise CorruptBlobError(
                f"shape/length mismatch: mixed payload is {data.size} bytes, plan and shape need "
                f"{num_codes + sum(sizes)}"
            )
        offsets = np.cumsum([num_codes, *sizes])
        scales_bytes, kept_bytes, fp8_bytes, *extra_bytes = (
            data[offsets[i] : offsets[i + 1]].copy() for i in range(len(sizes))
        )  # copies: the tensors must not alias a host slot that is about to be freed
        if header.flags & FLAG_ZSTD:
            kept_bytes = byte_unshuffle(kept_bytes, itemsize)
        kept = _bytes_as(kept_bytes, header.dtype, (plan.num_fp16, 2, num_tokens, head_dim))
        fp8 = _bytes_as(fp8_bytes, torch.float8_e4m3fn, (plan.num_fp8, 2, num_tokens, head_dim))
        scales = _bytes_as(scales_bytes, torch.float32, (plan.num_fp8, 2))
        extra = tuple(
            _bytes_as(rows, torch.uint8, (plan.count(cls), rows.size // max(1, plan.count(cls))))
            for cls, rows in zip(EXTRA_CLASSES, extra_bytes, strict=True)
        ) if has_formats else ()  # fmt: skip
        return QuantizedKV(plan, num_tokens, head_dim, header.dtype, kept, fp8, scales, extra)

    def decode(self, blob: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
        from preempt.kernels.restore_blocks import dequantize_heads_ref

        return dequantize_heads_ref(self.decode_quantized(blob))

    # ---- the device side: quantize where the KV lives, fused with the block gather, so only
    # the packed bytes cross PCIe; a restore dequantizes straight into the new blocks.

    @classmethod
    def build(cls, options: Mapping[str, Any], num_layers: int, num_kv_heads: int, seed: int = 0) -> Codec:
        """`options`: `plan` (`fp16`, `fp8`, `random` or a plan file), `fp8_share` and
        `drop_share` (the `random` plan's), `zstd`, `level`. The plan is shaped
        (num_layers, num_kv_heads) unless it comes from a file (checked by whoever knows
        the cache it will meet). ValueError naming what is wrong."""
        from preempt.kernels.plan import HeadPlan

        options = dict(options)
        name = options.pop("plan", "random")
        # the design's random control (§9): 10% dropped, 50% FP8, 40% FP16 = 0.65x of FP16 bytes
        fp8_share, drop_share = options.pop("fp8_share", 0.5), options.pop("drop_share", 0.1)
        for key, share in (("fp8_share", fp8_share), ("drop_share", drop_share)):
            if not (isinstance(share, int | float) and 0 <= share <= 1):
                raise ValueError(f"{key} must be a number in [0, 1], got {share!r}")
        if fp8_share + drop_share > 1.0 + 1e-9:
            raise ValueError(f"fp8_share + drop_share must be <= 1, got {fp8_share} + {drop_share}")
        if name not in ("fp16", "fp8", "random") and not Path(str(name)).is_file():
            raise ValueError(f"plan '{name}' is neither fp16, fp8, random nor an existing plan file")
        if name == "fp16":
            plan = HeadPlan.all_fp16(num_layers, num_kv_heads)
        elif name == "fp8":
            plan = HeadPlan.all_fp8(num_layers, num_kv_heads)
        elif name == "random":
            plan = HeadPlan.random(
                num_layers, num_kv_heads, fp8_share=fp8_share, drop_share=drop_share, seed=seed
            )
        else:
            plan = HeadPlan.load(name)
        return cls(plan, **options)

    @property
    def size_ratio(self) -> float:
        """Stored bytes of KV under the plan over 16-bit KV (per-request scales excluded:
        they do not grow with tokens)."""
        if self._ratio is None or self._ratio[0] is not self.plan:
            self._ratio = (self.plan, plan_size_ratio(self.plan))
        return self._ratio[1]

    def gather(self, cache: PagedCache, block_ids: Sequence[int], start: int, num_tokens: int) -> Any:
        return cache.gather_quantized(block_ids, start, num_tokens, self.plan).to("cpu")

    def encode_gathered(self, gathered: Any) -> list[bytes | np.ndarray]:
        return self.encode_quantized(gathered)

    def decode_gathered(self, blob: bytes | bytearray | memoryview | np.ndarray) -> Any:
        return self.decode_quantized(blob)

    def scatter(
        self, decoded: Any, cache: PagedCache, block_ids: Sequence[int], start: int, num_tokens: int
    ) -> np.ndarray | None:
        return cache.scatter_quantized(decoded, block_ids, start, num_tokens)

    def device_time(self, nbytes: float, cost_model: Any) -> tuple[float, float]:
        """One HBM pass reading the raw and writing the packed bytes; the packed bytes cross."""
        packed = nbytes * self.size_ratio
        return cost_model.hbm_pass_time_s(nbytes + packed), packed

    def host_time_s(self, nbytes: float, mb_s: Mapping[str, float]) -> float:
        """No host work unless `zstd`, which then costs zstd's throughput too."""
        seconds = super().host_time_s(nbytes, mb_s)
        return seconds + _seconds(nbytes, mb_s.get("zstd", 0.0)) if self.zstd else seconds

    def stored_share(self, modelled_ratio: float) -> float:
        return self.size_ratio  # the plan fixes it (0 for an all-DROP plan)

    @property
    def loses_precision(self) -> bool:
        plan = self.plan
        return plan is not None and plan.num_fp16 < plan.num_layers * plan.num_kv_heads

    def check_shape(self, num_layers: int, num_kv_heads: int) -> None:
        self.plan.check_shape(num_layers, num_kv_heads)


class Fp8Codec(MixedCodec):
    """Every KV head float8 E4M3, one scale per (layer, head, K or V): `mixed` with the
    all-FP8 plan (its blobs are laid out as `mixed`'s, under their own codec id). Half the
    bytes of 16-bit KV, no plan to choose."""

    name = "fp8"
    codec_id = 3

    @classmethod
    def build(cls, options: Mapping[str, Any], num_layers: int, num_kv_heads: int, seed: int = 0) -> Codec:
        return super().build({**options, "plan": "fp8"}, num_layers, num_kv_heads, seed)


def plan_size_ratio(plan: Any) -> float:
    """Stored bytes of KV under `plan` over 16-bit KV: what the plan saves on a 16-bit
    deployment (per-request scales excluded: they do not grow with tokens)."""
    if not plan.is_legacy:
        # KIVI / per-token classes cost depends on the length and head_dim: price them at a
        # nominal 1024-token request of 128-wide heads (Llama-3-8B's), scales included.
        from preempt.kernels.plan import size_vs_fp16

        return size_vs_fp16(plan, 1024, 128)
    total = plan.num_layers * plan.num_kv_heads
    return (2 * plan.num_fp16 + plan.num_fp8) / (2 * total)


def byte_shuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    """(n * itemsize,) uint8 -> byte planes: all bytes 0, then all bytes 1, ... (a new array)."""
    return data.reshape(-1, itemsize).T.copy().reshape(-1)


def byte_unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of byte_shuffle. One strided write per plane: ~5x faster here than `.T.copy()`,
    whose strided reads thrash the cache."""
    planes = planes.reshape(itemsize, -1)
    out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for i in range(itemsize):
        out[:, i] = planes[i]
    return out.reshape(-1)


class _CodecClasses(Mapping[str, type[Codec]]):
    """Name -> codec class, read from `preempt.core.registry.CODECS` (the one home of codec
    names, a codec registered there by decorator included); a class is imported when first
    read. Options are the class's keyword arguments."""

    def __getitem__(self, name: str) -> type[Codec]:
        if name not in registry.CODECS.names():
            raise KeyError(name)
        cls = registry.CODECS.resolve(name)
        if not (isinstance(cls, type) and issubclass(cls, Codec)):
            raise ValueError(f"codec '{name}' is not a preempt.kv.codec.Codec subclass")
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(registry.CODECS.names())

    def __len__(self) -> int:
        return len(registry.CODECS.names())

    def __repr__(self) -> str:
        return f"CODECS({dict(self)!r})"


CODECS: Mapping[str, type[Codec]] = _CodecClasses()
"""The registered codecs, name -> class: a read-only view of `preempt.core.registry.CODECS`."""


def make_codec(name: str, **options: Any) -> Codec:
    """A codec by registry name, e.g. make_codec("zstd", level=3, shuffle=True)."""
    try:
        cls = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(CODECS))}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options {options} for codec {name!r}: {exc}") from exc


def decode_blob(blob: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    """Decode a blob with whichever registered codec wrote it (default options)."""
    codec_id = read_header(blob).codec_id
    for cls in CODECS.values():
        if cls.codec_id == codec_id:
            return cls().decode(blob)
    raise CorruptBlobError(f"unknown codec id {codec_id} in blob header")


# ---- helpers (`tensor_bytes`, `bytes_to_tensor`, `byte_shuffle`: for codec authors too) --------------


def _seconds(nbytes: float, mb_per_s: float) -> float:
    return nbytes / (mb_per_s * 1e6) if mb_per_s > 0 else 0.0


def tensor_bytes(kv: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a CPU tensor's bytes (a copy only if `kv` is not contiguous).
    Going through torch.uint8 covers dtypes numpy lacks (bfloat16, float8)."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"encode() takes a torch.Tensor, got {type(kv).__name__}")
    if kv.device.type != "cpu":
        raise ValueError(f"encode() takes a CPU tensor, got one on {kv.device}: move KV to host first")
    if kv.dtype not in _DTYPE_CODES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
        raise ValueError(f"encode() does not support dtype {kv.dtype}; supported: {names}")
    if kv.ndim > 255:
        raise ValueError(f"encode() supports at most 255 dims, got {kv.ndim}")
    return kv.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_to_tensor(data: np.ndarray, header: BlobHeader) -> torch.Tensor:
    """Reinterpret a writable (raw_nbytes,) uint8 array, which the tensor then owns."""
    return _bytes_as(data, header.dtype, header.shape)


def _bytes_as(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if data.size == 0:  # torch refuses to view a zero-size array with stride 0 as a wider dtype
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _readinto_full(reader: Any, out: memoryview) -> int:
    filled = 0
    while filled < out.nbytes:
        count = reader.readinto(out[filled:])
        if count == 0:
            break
        filled += count
    return filled


def _as_byte_view(blob: Any) -> memoryview:
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8 or blob.device.type != "cpu":
            raise TypeError(f"a blob tensor must be uint8 on the CPU, got {blob.dtype} on {blob.device}")
        blob = blob.contiguous().numpy()
    try:
        view = memoryview(blob)
    except TypeError as exc:
        raise TypeError(f"a blob must be bytes-like, got {type(blob).__name__}") from exc
    if not view.contiguous:
        raise TypeError("a blob must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
