"""An `hf` checkpoint behind the server: its tokenizer_config.json chat template renders the
prompt (as transformers renders it), its EOS id ends a request, and ignore_eos overrides."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from preempt.serve.chat import ChatTemplate
from tests.serve.conftest import LiveServer, running_server, serve_config

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 64
WORDS = [f"w{i}" for i in range(VOCAB - 3)] + ["<s>", "</s>", "[UNK]"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}U {{ m['content'] }} "
    "{% elif m['role'] == 'system' %}S {{ m['content'] }} {% else %}A {{ m['content'] }} {{ eos_token }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
)


def write_checkpoint(directory: Path, eos_id: int | None) -> None:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {word: i for i, word in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    (directory / "config.json").write_text(
        json.dumps({**json.loads((directory / "config.json").read_text())})
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf_chat")
    write_checkpoint(directory, eos_id=None)
    return directory


def hf_server(directory: Path) -> Iterator[LiveServer]:
    config = serve_config(
        model={"backend": "hf", "checkpoint": str(directory), "max_model_len": 128, "preset": "tiny-2l"}
    )
    return running_server(config)


MESSAGES = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]


def test_template_renders_like_transformers(checkpoint: Path) -> None:
    ours = ChatTemplate.from_checkpoint(checkpoint)
    assert ours is not None
    messages = [(m["role"], m["content"]) for m in MESSAGES]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = TEMPLATE
    expected = fast.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages) == expected == "<s>S w1 w2 U w3 A"


def test_eos_ends_a_request_unless_ignore_eos(checkpoint: Path, tmp_path: Path) -> None:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with hf_server(checkpoint) as live:
        first = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
        ids = httpx.post(
            f"{live.url}/generate", json={"prompt": "<s>S w1 w2 U w3 A", "max_tokens": 12}, timeout=60
        ).json()["token_ids"]
    # The rendered template is the prompt, in the checkpoint's own tokenizer.
    rendered = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode("<s>S w1 w2 U w3 A")
    assert first["usage"]["prompt_tokens"] == len(rendered.ids) and first["usage"]["completion_tokens"] == 12
    # Make the 4th greedy token the checkpoint's EOS: the same request now stops there.
    eos = ids[3]
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "ckpt").mkdir()
    for path in checkpoint.iterdir():
        (tmp_path / "ckpt" / path.name).write_bytes(path.read_bytes())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    with hf_server(tmp_path / "ckpt") as live:
        stopped = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
        ignored = httpx.post(
            f"{live.url}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60
        ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == ids.index(eos) + 1
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 12
