"""Random-weight Llama checkpoints that vLLM serves from a directory, offline.

Owns: the shapes (`PRESETS`) and `write_random_llama`, which writes a Hugging Face
checkpoint (config.json + safetensors) with random weights and, for the served presets, the
byte-level tokenizer (`preempt.model.tokenizer.write_byte_tokenizer`) and a chat template.
Nothing is downloaded. Random weights make timing real and outputs meaningless: wherever
such a model's text is shown, it is noise. Imports torch and transformers on call only.

The presets:
- `tiny` (0.2M parameters): vLLM's in-process tests (bench vllm, the plugin's tests).
- `served` (3M): the HTTP benches' model; its output head is scaled so greedy tokens lead
  by a margin no batch shape changes (outputs are compared token for token across arms).
- `fidelity` (27M, float32): `preempt bench fidelity`'s model, where recomputing costs: a
  prefill of 1,024 tokens takes about a second on two CPU cores and a decode step of a
  few sequences tens of ms (docs/fidelity.md gives the measured numbers). float32 because
  a CPU without avx512_bf16 emulates bfloat16 (several times slower).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64: vLLM's CPU attention has no kernel for 16
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Byte-level chat turns: enough for /v1/chat/completions to render.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]  # LlamaConfig fields
    dtype: str = "bfloat16"
    # Multiplies the output head's weights: at the standard init (std 0.02) a random
    # model's logits are nearly flat, so its greedy argmax flips with the last bits of a
    # matmul, which differ with the batch's shape; scaled, the top token leads by a margin.
    logit_scale: float = 1.0
    tokenizer: bool = False  # the byte-level tokenizer and chat template (text prompts)
    notes: tuple[str, ...] = field(default=())


PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY),
    # more compute per step than tiny, so that a served step is the worker's matmuls more
    # than the Python the API server, the engine core and the client share two cores with
    "served": Preset(
        {**_TINY, "vocab_size": 256, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
        logit_scale=25.0, tokenizer=True,
    ),
    "fidelity": Preset(
        {**_TINY, "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4},
        dtype="float32", logit_scale=25.0, tokenizer=True,
    ),
}  # fmt: skip


def write_random_llama(model_dir: Path, preset: str = "served", seed: int = 0) -> Path:
    """Write `PRESETS[preset]` with seeded random weights to `model_dir`, unless a
    checkpoint is there (config.json, written last, is the mark)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown checkpoint preset '{preset}'; choose one of {sorted(PRESETS)}")
    model_dir = Path(model_dir)
    if (model_dir / "config.json").is_file():
        return model_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = PRESETS[preset]
    model_dir.mkdir(parents=True, exist_ok=True)
    if spec.tokenizer:
        from preempt.model.tokenizer import write_byte_tokenizer

        write_byte_tokenizer(model_dir)
        path = model_dir / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**spec.config))
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.logit_scale)
    model.to(getattr(torch, spec.dtype)).save_pretrained(model_dir)
    return model_dir


def num_params(preset: str) -> int:
    """Parameters of a preset (untied embedding and head, as written)."""
    c = PRESETS[preset].config
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    attn = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim + h * h
    return layers * (attn + 3 * h * i + 2 * h) + h + 2 * c["vocab_size"] * h
