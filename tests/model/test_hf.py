"""The `hf` backend: tiny random Llama and Qwen2 checkpoints written by `transformers` load
into TinyLM and reproduce transformers' logits and greedy generations (naive and paged
paths), and broken or unsupported checkpoints fail with an error naming the problem.

transformers is imported here only (the library never needs it); its import costs ~4 s.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from preempt.core.config import build_config
from preempt.engine.engine import Engine
from preempt.model.hf import CheckpointError, load_hf_model, load_hf_tokenizer, tiny_config_from_hf
from preempt.model.tiny import RopeScaling, TinyConfig, TinyLM, generate_naive, rope_inv_freq
from preempt.model.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

VOCAB = 300  # > 256: prompt ids past the byte range must work
NUM_NEW = 12
# Llama 3 RoPE scaling with a short original context, so that with head_dim 16 the 8
# frequencies fall into all three bands (kept, interpolated, divided by `factor`).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,  # generate() must not stop early
    pad_token_id=None,
)


def _randomize(model: torch.nn.Module, seed: int, embed_std: float) -> None:
    """transformers' init (std 0.02, zero biases, unit norms) makes a random model a bigram
    table and leaves biases and norm gains untested: redraw everything at unit scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif param.ndim == 1:  # biases
                param.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                param.copy_(embed_std * noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)


def _save(hf_config, directory: Path, seed: int, **save_kwargs):
    """A random model of `hf_config` saved to `directory`; returns it in float64."""
    # Tied and at unit scale, the token's own embedding dominates the last hidden state
    # and every greedy run repeats one token; small embeddings let the layers steer.
    embed_std = 0.1 if hf_config.tie_word_embeddings else 1.0
    auto = transformers.AutoModelForCausalLM
    with torch.random.fork_rng():  # transformers' init draws from the global RNG
        model = auto.from_config(hf_config, attn_implementation="eager")
    _randomize(model, seed, embed_std)
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE), rms_norm_eps=1e-5)
    return directory, _save(config, directory, seed=1)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_parameters={"rope_theta": 5e4})
    # Small shards: exercises model.safetensors.index.json.
    return directory, _save(config, directory, seed=2, max_shard_size="40KB")


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]  # (T, V)


@torch.inference_mode()
def _hf_generate(model, ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
        max_new_tokens=NUM_NEW, do_sample=False,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


# ---------------------------------------------------------------- config translation


def test_configs_translate(llama, qwen2) -> None:
    cfg = load_hf_model(llama[0], torch.float64).cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        2,
        64,
        4,
        2,
        16,
    )
    assert cfg.vocab_size == VOCAB and cfg.norm_eps == 1e-5 and not cfg.tie_word_embeddings
    assert not (cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias)
    assert cfg.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 4.0, 64)
    cfg = load_hf_model(qwen2[0], torch.float64).cfg
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 5e4 and cfg.rope_scaling is None


def test_legacy_config_layout_reads_the_same() -> None:
    """transformers < 5 wrote rope_theta / rope_scaling (with `type`) at the top level."""
    new = {"architectures": ["LlamaForCausalLM"], **COMMON, "rope_parameters": LLAMA3_ROPE}
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = 10000.0
    old["rope_scaling"] = {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}
    assert tiny_config_from_hf(old) == tiny_config_from_hf(new)


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(16, 10000.0, RopeScaling("llama3", 4.0, 1.0, 4.0, 64))
    torch.testing.assert_close(ours, expected.to(torch.float64), rtol=1e-6, atol=0)
    # all three bands present: kept, interpolated, divided by the factor
    ratio = (ours / rope_inv_freq(16, 10000.0)).tolist()
    assert ratio[0] == 1 and ratio[-1] == pytest.approx(0.25) and any(0.25 < r < 1 for r in ratio[1:-1])


def test_defaults_keep_the_plain_tiny_model() -> None:
    """The new switches are off by default and the biases draw nothing from the seeded init."""
    base = TinyConfig(256, 1, 64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64)
    biased = TinyConfig(256, 1, 64, 4, 2, 16, 64, attention_bias=True, o_proj_bias=True, mlp_bias=True)
    a, b = TinyLM(base, seed=5), TinyLM(biased, seed=5)
    assert sum(p.numel() for p in b.parameters()) == biased.num_params
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name
    assert all(torch.all(p == 0) for n, p in params_b.items() if n.endswith(".bias"))
    tied = TinyConfig(256, 1, 64, 4, 2, 16, 64, tie_word_embeddings=True)
    model = TinyLM(tied, seed=5)
    assert model.lm_head.weight is model.embed_tokens
    assert sum(p.numel() for p in model.parameters()) == tied.num_params


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float64_logits_and_greedy_match_transformers(family, request) -> None:
    directory, hf_model = request.getfixturevalue(family)
    model = load_hf_model(directory, "float64")
    assert model.dtype == torch.float64
    ids = _prompt(0, 40)
    ours, theirs = model.forward_naive(torch.tensor(ids)), _hf_logits(hf_model, ids)
    # transformers computes RoPE's cos/sin in float32 even in a float64 model: ~1e-7 relative.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.5  # unit-scale weights: real margins between candidate tokens
    for seed, length in [(1, 3), (2, 19)]:
        prompt = _prompt(seed, length)
        expected = _hf_generate(hf_model, prompt)
        assert len(set(expected)) > 2  # the context steers the tokens (no fixed point)
        assert generate_naive(model, prompt, NUM_NEW) == expected


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float32_and_bfloat16_loads(family, request) -> None:
    directory, hf_model = request.getfixturevalue(family)
    ids = _prompt(3, 24)
    theirs = _hf_logits(hf_model, ids)
    model32 = load_hf_model(directory, torch.float32)
    ours = model32.forward_naive(torch.tensor(ids))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4)
    model16 = load_hf_model(directory, "bfloat16")
    assert model16.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        model16.layers[0].mlp.up_proj.weight, hf_model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16)
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_paged_engine_matches_transformers(family, request) -> None:
    """Batched, chunked (16-token budget), paged, and preempting (a 12-block pool cannot
    hold the three requests at once) generation equals transformers' greedy generate."""
    directory, hf_model = request.getfixturevalue(family)
    config = build_config({
        "model": {"backend": "hf", "checkpoint": str(directory), "dtype": "float64", "max_model_len": 256,
                  "num_threads": 1},
        "cache": {"block_size": 4, "num_blocks": 12},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 16},
    })  # fmt: skip
    prompts = [_prompt(10, 5), _prompt(11, 23), _prompt(12, 17)]
    engine = Engine(config)
    try:
        outputs = engine.generate(prompts, max_tokens=NUM_NEW)
    finally:
        engine.close()
    assert engine.runner.vocab_size == VOCAB and engine.stats()["num_preemptions"] > 0
    assert outputs == [_hf_generate(hf_model, p) for p in prompts]


def test_cli_replays_a_trace_on_a_checkpoint(llama, tmp_path) -> None:
    from preempt.cli import main

    def run(checkpoint: Path) -> int:
        return main(["run", "--out", str(tmp_path / "run"), "--trace", "azure-conv", "--duration", "5",
                     "--no-progress", "--set", "model.backend=hf", "--set", f"model.checkpoint={checkpoint}",
                     "--set", "model.num_threads=1"])  # fmt: skip

    assert run(llama[0]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_finished"] == summary["num_requests"] > 0
    assert summary["config"]["model"]["backend"] == "hf"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert run(bad) == 2  # a one-line error, no traceback


# ---------------------------------------------------------------- errors


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


DELETE = object()  # a config change that removes the key


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not DELETE}))


def _rewrite_weights(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_paths_fail_clearly(tmp_path, llama) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_model("meta-llama/Llama-3.2-1B")  # a hub id is never fetched
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_model(tmp_path)
    directory = _copy(llama[0], tmp_path / "noweights")
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights \(found pytorch_model.bin"):
        load_hf_model(directory)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture MistralForCausalLM"),
        ({"architectures": None, "model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn' is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantized checkpoints \(awq\)"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"hidden_size": DELETE}, "missing key 'hidden_size'"),
    ],
)
def test_unsupported_configs_are_named(tmp_path, llama, changes, message) -> None:
    directory = _copy(llama[0], tmp_path / "ckpt")
    _edit_config(directory, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(directory)


def test_qwen2_sliding_window_is_rejected(tmp_path, qwen2) -> None:
    directory = _copy(qwen2[0], tmp_path / "ckpt")
    _edit_config(directory, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(CheckpointError, match="sliding-window"):
        load_hf_model(directory)


def test_bad_tensors_are_named(tmp_path, llama) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    directory = _copy(llama[0], tmp_path / "missing")
    _rewrite_weights(directory, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensors: layers.1.mlp.up_proj.weight"):
        load_hf_model(directory)
    directory = _copy(llama[0], tmp_path / "extra")
    _rewrite_weights(directory, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensors: model.layers.0.mlp.extra.weight"):
        load_hf_model(directory)
    directory = _copy(llama[0], tmp_path / "shape")
    _edit_config(directory, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.\w+_proj.weight' .* shape \("):
        load_hf_model(directory)


def test_token_ids_outside_a_small_vocab_fail_clearly() -> None:
    """Trace prompts are printable ASCII [32, 127): a model with fewer ids gets a clear error."""
    model = TinyLM(TinyConfig(100, 1, 32, 2, 1, 16, 32), seed=0)
    with pytest.raises(ValueError, match=r"token id 120 is outside the model's vocabulary \[0, 100\)"):
        model.forward_naive(torch.tensor([5, 120]))


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_from_checkpoint_or_bytes(tmp_path, llama) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    with pytest.warns(UserWarning, match="no tokenizer.json: using the byte tokenizer"):
        assert isinstance(load_hf_tokenizer(llama[0]), ByteTokenizer)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_hf_tokenizer(tmp_path)
    assert loaded.encode("hello world hello") == [1, 2, 1]
    assert loaded.decode([2, 1]) == "world hello" and loaded.vocab_size == 3
