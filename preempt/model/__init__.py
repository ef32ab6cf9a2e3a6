"""Model code of the engine: the `tiny` Llama-style decoder, paged attention, tokenizer.

Owns: modules and pure tensor functions. It never allocates the KV pool (kv_cache does),
never decides what runs (the scheduler does) and never samples (the model runner does).
"""

from preempt.model.attention import AttentionMetadata, build_attention_metadata, paged_attention, write_kv
from preempt.model.tiny import PRESETS, TinyConfig, TinyLM, generate_naive, get_preset
from preempt.model.tokenizer import ByteTokenizer

__all__ = [
    "PRESETS",
    "AttentionMetadata",
    "ByteTokenizer",
    "TinyConfig",
    "TinyLM",
    "build_attention_metadata",
    "generate_naive",
    "get_preset",
    "paged_attention",
    "write_kv",
]
