"""`lz4`: LZ4 block compression of the KV's bytes (optionally byte-shuffled first, as `zstd`).

LZ4 gives up ratio for speed: no entropy coder, so 16-bit KV barely compresses, but it runs
several times faster than zstd level 3 on one core. It is the lossless codec to try where
zstd's host time is what hurts (the `zstd_critical_path` claim: CPU zstd costs more KV wait
than its smaller blobs save); `lz4_critical_path` asks whether a faster codec changes that
(`preempt ablate --config preempt/configs/codecs.yaml`, docs/codec.md).

Calibration (`preempt bench save`, 2026-12-07, this 2-core machine, bfloat16 KV of the tiny
model, 16 MB), relative to zstd (level 3, shuffled: the default) in the same run and scaled
onto zstd's calibrated numbers (480 / 1000 MB/s, ratio 1.15):
- save 2374.5 MB/s against zstd's 274.2 (8.66x) -> encode 4160 MB/s;
- restore 3298.9 MB/s against zstd's 1144.5 (2.88x) -> decode 2880 MB/s;
- ratio 1.278 against zstd's 2.005 on the same bytes: 28% of zstd's gain -> 1.04.
Shuffled, LZ4 compresses more (1.68) but the numpy shuffle makes it as slow as zstd
(451 MB/s): off by default.

Payload: one LZ4 block of the (shuffled) bytes, without LZ4's own size prefix: the blob's
header holds the raw length, which bounds the decompression. python-lz4 releases the GIL
while it (de)compresses, so a save worker's encode overlaps the engine's steps.
"""

from __future__ import annotations

import lz4.block
import numpy as np

from preempt.core.config import CodecCalibration
from preempt.kv.codec import CorruptBlobError, ShuffledBytesCodec


class Lz4Codec(ShuffledBytesCodec):
    """LZ4 over the tensor's bytes; `shuffle` groups byte 0 of every element, then byte 1,
    ... first (a no-op for 1-byte dtypes); `acceleration` > 1 trades ratio for speed
    (LZ4's fast mode)."""

    name = "lz4"
    codec_id = 4
    calibration = CodecCalibration(encode_mb_s=4160, decode_mb_s=2880, modelled_ratio=1.04)  # see above

    def __init__(self, acceleration: int = 1, shuffle: bool = False) -> None:
        if not isinstance(acceleration, int) or acceleration < 1:
            raise ValueError(f"lz4 acceleration must be an int >= 1, got {acceleration!r}")
        self.acceleration = acceleration
        self.shuffle = bool(shuffle)

    def __repr__(self) -> str:
        return f"Lz4Codec(acceleration={self.acceleration}, shuffle={self.shuffle})"

    def compress(self, data: np.ndarray) -> bytes:
        return lz4.block.compress(data, mode="fast", acceleration=self.acceleration, store_size=False)

    def decompress(self, payload: memoryview, raw_nbytes: int) -> np.ndarray:
        if raw_nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        try:  # raw_nbytes bounds the output
            data = lz4.block.decompress(payload, uncompressed_size=raw_nbytes, return_bytearray=True)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptBlobError(f"lz4 payload does not decompress: {exc}") from exc
        if len(data) != raw_nbytes:
            raise CorruptBlobError(
                f"shape/length mismatch: lz4 payload decompresses to {len(data)} bytes, "
                f"shape needs {raw_nbytes}"
            )
        return np.frombuffer(data, dtype=np.uint8)  # writable: a bytearray the tensor then owns
