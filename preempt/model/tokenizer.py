"""Byte-level tokenizer: token id i is byte i.

Owns: the text <-> token-id mapping of the `tiny` backend. It has no special tokens, because
generation length always comes from the trace, never from an end-of-sequence token. It
must never depend on a vocabulary file, so every machine tokenizes identically. Also the
same mapping as a Hugging Face tokenizer directory (`write_byte_tokenizer`), for clients
that count tokens with one (load generators, vLLM serving a byte-level model).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the `tokenizers` ByteLevel
    pre-tokenizer applies before the model sees the text: vocabulary keys must be these
    characters for token id b to mean byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def write_byte_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) whose ids are the
    UTF-8 bytes, as `preempt.model.tokenizer.ByteTokenizer`'s: a BPE with the 256 byte
    symbols and no merges, no regex split, no prefix space, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
