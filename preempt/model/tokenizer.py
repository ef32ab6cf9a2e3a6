"""Byte-level tokenizer: token id i is byte i.

Owns: the text <-> token-id mapping of the `tiny` backend. It has no special tokens, because
generation length always comes from the trace, never from an end-of-sequence token. It
must never depend on a vocabulary file, so every machine tokenizes identically.
"""

from __future__ import annotations

import codecs

VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces invalid byte sequences with U+FFFD."""

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        # A sampled sequence need not be valid UTF-8: replace, never raise.
        return bytes(token_ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()


class ByteStreamDecoder:
    """Streams text as tokens arrive: a byte may end mid-character, so the incremental
    UTF-8 decoder holds it until the character completes; the pieces concatenate to
    `decode(all ids)`."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(token_ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
