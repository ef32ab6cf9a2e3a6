"""Streaming decoders: pieces concatenate to the whole text, and a character split across
tokens is held back until it completes (byte tokenizer and subword tokenizers alike)."""

from __future__ import annotations

from preempt.model.hf import TextDiffStreamDecoder
from preempt.model.tokenizer import ByteTokenizer


def test_byte_stream_decoder_holds_a_split_character():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("a€b")  # € is 3 bytes
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.push(ids[:2]), decoder.push(ids[2:4]), decoder.push(ids[4:]), decoder.flush()]
    assert pieces[0] == "a" and pieces[1] == "€"
    assert "".join(pieces) == "a€b"


class _ByteLevelSubwords:
    """A stand-in subword tokenizer whose ids are bytes, decoded with replacement: its
    partial decodes end in U+FFFD exactly when a character is split, as real BPE ones do."""

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_text_diff_stream_decoder_emits_only_new_complete_text():
    ids = list("x€y€".encode())
    decoder = TextDiffStreamDecoder(_ByteLevelSubwords())
    pieces = [decoder.push([token]) for token in ids] + [decoder.flush()]
    assert "".join(pieces) == "x€y€"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[:4] == ["x", "", "", "€"]
