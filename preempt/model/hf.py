"""The `hf` backend: Llama- and Qwen2-family checkpoints from a local directory.

Owns: reading a Hugging Face checkpoint directory (config.json + one or several
`*.safetensors` files, sharded through `model.safetensors.index.json`), translating its
config into a `TinyConfig` (the engine has one decoder class, `TinyLM`), copying the
tensors into it with dtype conversion, and the checkpoint's tokenizer (`tokenizer.json`
through the `tokenizers` package when it is installed, else the byte tokenizer).

It never touches the network (no hub ids, no downloads: a path that is not a local
directory is an error), never imports `transformers` (tests compare against it; the
library must not need it), and fails with one clear message naming the file, key or
tensor at fault rather than loading something half right.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from preempt.core.config import ConfigError
from preempt.model.tiny import ROPE_SCALING_TYPES, RopeScaling, TinyConfig, TinyLM, resolve_dtype
from preempt.model.tokenizer import ByteTokenizer

# architectures entry of config.json -> its model_type
SUPPORTED_ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

# Defaults of the config.json keys a checkpoint may omit, per model_type (transformers'
# LlamaConfig / Qwen2Config defaults).
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 10000.0}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768}


class CheckpointError(ConfigError):
    """A checkpoint directory the `hf` backend cannot load, with the reason. A ConfigError
    (so a ValueError): `model.checkpoint` named it, and the CLI reports it in one line."""


# ---------------------------------------------------------------- config


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of checkpoint directory `path` as a dict."""
    directory = _checkpoint_dir(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint '{directory}' has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def model_type_of(config: dict[str, Any]) -> str:
    """'llama' or 'qwen2', from `architectures` (or `model_type` when that is absent)."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if architectures:
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported or len(architectures) != 1:
            raise CheckpointError(
                f"unsupported architecture {', '.join(map(str, architectures))}; the hf backend loads "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return SUPPORTED_ARCHITECTURES[architectures[0]]
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise CheckpointError(
            f"unsupported model_type '{model_type}' (config.json has no architectures); the hf backend "
            f"loads {', '.join(SUPPORTED_ARCHITECTURES.values())}"
        )
    return model_type


def tiny_config_from_hf(config: dict[str, Any]) -> TinyConfig:
    """The `TinyConfig` of a Llama/Qwen2 config.json; features the decoder does not have
    (another activation, sliding windows, other RoPE scalings, quantized weights) are
    rejected by name rather than silently computed wrong."""
    model_type = model_type_of(config)

    def require(key: str) -> Any:
        if key not in config:
            raise CheckpointError(f"config.json: missing key '{key}'")
        return config[key]

    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"config.json: quantized checkpoints ({method}) are not supported")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(
            f"config.json: hidden_act '{activation}' is not supported (SwiGLU needs 'silu')"
        )
    if model_type == "qwen2" and _has_sliding_layers(config):
        raise CheckpointError("config.json: sliding-window attention (use_sliding_window) is not supported")

    hidden_size = int(require("hidden_size"))
    num_heads = int(require("num_attention_heads"))
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or hidden_size // num_heads)
    rope_theta, rope_scaling = _rope(config, model_type)
    if model_type == "llama":
        # Llama's attention_bias puts biases on q, k, v *and* o; Qwen2 always has q/k/v biases only.
        attention_bias = o_proj_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
    else:
        attention_bias, o_proj_bias, mlp_bias = True, False, False
    try:
        return TinyConfig(
            vocab_size=int(require("vocab_size")),
            num_layers=int(require("num_hidden_layers")),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(require("intermediate_size")),
            rope_theta=rope_theta,
            norm_eps=float(config.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            # Both families default to untied (transformers' LlamaConfig / Qwen2Config).
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from exc


def _has_sliding_layers(config: dict[str, Any]) -> bool:
    if not config.get("use_sliding_window", False):
        return False
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    # transformers' rule before layer_types: layers from max_window_layers on slide.
    return int(config.get("max_window_layers", 0)) < int(config.get("num_hidden_layers", 0))


def _rope(config: dict[str, Any], model_type: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either layout: transformers < 5 writes `rope_theta` and
    `rope_scaling` at the top level, transformers 5 one `rope_parameters` dict."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA[model_type])))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"config.json: partial_rotary_factor {partial} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALING_TYPES:
        # dynamic NTK depends on the sequence length and yarn also rescales attention: neither
        # is one fixed frequency table, so refuse rather than approximate.
        raise CheckpointError(
            f"config.json: RoPE scaling '{rope_type}' is not supported "
            f"(supported: default, {', '.join(ROPE_SCALING_TYPES)})"
        )
    if "factor" not in params:
        raise CheckpointError(f"config.json: RoPE scaling '{rope_type}' has no 'factor'")
    original = params.get(
        "original_max_position_embeddings",
        config.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]),
    )
    try:
        return theta, RopeScaling(
            rope_type,
            float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from exc


# ---------------------------------------------------------------- weights


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of checkpoint directory `path`: the shards its index names,
    else model.safetensors, else every *.safetensors file."""
    directory = _checkpoint_dir(path)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index (no weight_map)") from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path} names missing shard(s): {', '.join(missing)}")
        return files
    if (directory / SINGLE_WEIGHTS_FILE).is_file():
        return [directory / SINGLE_WEIGHTS_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt")
        )
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise CheckpointError(f"checkpoint '{directory}' has no *.safetensors weights{hint}")
    return files


def _checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, tensor name, tensor) of every tensor, one at a time: peak memory is
    the model plus one tensor, whatever the checkpoint's size."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield file.name, name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def engine_name(hf_name: str) -> str | None:
    """TinyLM's parameter name of a checkpoint tensor; None for tensors to skip."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer some older exports saved; recomputed from the config
    if hf_name == "lm_head.weight":
        return hf_name
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens"
    if hf_name.startswith("model."):
        return hf_name.removeprefix("model.")
    return hf_name  # unknown: reported as unexpected by the loader


@torch.no_grad()
def load_hf_model(path: str | Path, dtype: torch.dtype | str = torch.float32) -> TinyLM:
    """The Llama/Qwen2 checkpoint in local directory `path` as a `TinyLM` of `dtype`.
    Raises CheckpointError naming the problem: no directory, no config.json, an unsupported
    architecture or feature, no weights, a missing, unexpected or mis-shaped tensor."""
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    cfg = tiny_config_from_hf(read_hf_config(path))
    files = weight_files(path)
    model = TinyLM(cfg, dtype=dtype, init_weights=False)
    params = dict(model.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    loaded: dict[str, str] = {}  # engine name -> file it came from
    unexpected: list[str] = []
    for file_name, hf_name, tensor in _checkpoint_tensors(files):
        name = engine_name(hf_name)
        if name is None:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head (transformers ties the same way)
        if name not in params:
            unexpected.append(hf_name)
            continue
        if name in loaded:
            raise CheckpointError(f"tensor '{hf_name}' appears twice ({loaded[name]} and {file_name})")
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor '{hf_name}' in {file_name} has shape {tuple(tensor.shape)}, the config "
                f"implies {tuple(param.shape)}"
            )
        param.copy_(tensor)  # converts to the model's dtype
        loaded[name] = file_name
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensors: {_some(unexpected)}")
    missing = [name for name in params if name not in loaded]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {_some(missing)}")
    return model.eval()


def _some(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _checkpoint_dir(path: str | Path | None) -> Path:
    if not path:
        raise CheckpointError("no checkpoint directory given (model.checkpoint)")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        # Deliberately no hub fallback: a name like 'meta-llama/Llama-3.2-1B' is not fetched.
        raise CheckpointError(
            f"checkpoint directory '{directory}' does not exist (only local paths are loaded)"
        )
    return directory


# ---------------------------------------------------------------- tokenizer


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through the `tokenizers` package, with the
    ByteTokenizer's interface. Encoding adds the tokenizer's own special tokens (e.g.
    Llama's BOS), as `transformers` does by default; decoding skips them."""

    def __init__(self, tokenizer_path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream_decoder(self) -> TextDiffStreamDecoder:
        return TextDiffStreamDecoder(self)


class TextDiffStreamDecoder:
    """Streams a subword tokenizer's text: decode everything so far and emit what is new,
    holding back a trailing U+FFFD (a character whose bytes span tokens not all here yet).
    Quadratic in the output length, which is fine for one request's stream."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text already emitted

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids)
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if end <= self._sent:
            return ""
        piece, self._sent = text[self._sent : end], end
        return piece

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        piece, self._sent = text[self._sent :], len(text)
        return piece


def load_hf_tokenizer(path: str | Path) -> HFTokenizer | ByteTokenizer:
    """The tokenizer of checkpoint directory `path`: its tokenizer.json when the optional
    `tokenizers` package is installed, else the byte tokenizer (with a warning: its ids
    mean nothing to a real model's vocabulary)."""
    directory = _checkpoint_dir(path)
    tokenizer_path = directory / TOKENIZER_FILE
    reason = None
    if not tokenizer_path.is_file():
        reason = f"'{directory}' has no {TOKENIZER_FILE}"
    else:
        try:
            return HFTokenizer(tokenizer_path)
        except ImportError:
            reason = "the 'tokenizers' package is not installed"
    warnings.warn(
        f"{reason}: using the byte tokenizer, whose ids are not the model's vocabulary", stacklevel=2
    )
    return ByteTokenizer()
