"""`lm.pt`: round trip with weights_only, dtypes, and one clear error per bad file."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from preempt.model.checkpoint import FORMAT, checkpoint_meta, load_tiny_lm, read_tiny_lm, save_tiny_lm
from preempt.model.tiny import RopeScaling, TinyLM
from tests.lm import TEST_CONFIG

torch.set_num_threads(1)


@pytest.fixture
def saved(tmp_path):
    model = TinyLM(TEST_CONFIG, seed=3)
    path = tmp_path / "lm.pt"
    save_tiny_lm(model, path, {"note": "test", "metrics": {"test_bpb": 2.5}})
    return model, path


def test_round_trip_is_exact_and_weights_only(saved):
    model, path = saved
    blob = torch.load(path, weights_only=True)  # no pickled classes in the file
    assert blob["format"] == FORMAT and blob["version"] == 1
    assert blob["config"] == dataclasses.asdict(TEST_CONFIG)
    loaded = load_tiny_lm(path)
    assert loaded.cfg == TEST_CONFIG and not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    ids = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(loaded.forward_naive(ids), model.forward_naive(ids), rtol=0, atol=0)
    assert checkpoint_meta(path) == {"note": "test", "metrics": {"test_bpb": 2.5}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_load_casts_to_the_requested_dtype(saved, dtype):
    model, path = saved
    loaded = load_tiny_lm(path, dtype=dtype)
    assert all(p.dtype == dtype for p in loaded.parameters())
    assert read_tiny_lm(path)["state_dict"]["lm_head.weight"].dtype == torch.float32  # stored float32
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight.to(dtype), rtol=0, atol=0)


def test_saving_a_bfloat16_model_stores_float32(tmp_path):
    path = tmp_path / "bf16.pt"
    save_tiny_lm(TinyLM(TEST_CONFIG, dtype=torch.bfloat16), path, {})
    assert all(t.dtype == torch.float32 for t in read_tiny_lm(path)["state_dict"].values())


def _rewrite(path, **changes):
    blob = torch.load(path, weights_only=True)
    blob.update(changes)
    torch.save(blob, path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.unlink(), "file not found"),
        (lambda p: p.write_bytes(b"not a checkpoint"), "not a readable torch checkpoint"),
        (lambda p: torch.save({"weights": 1}, p), "format is None"),
        (lambda p: _rewrite(p, format="something-else"), "format is 'something-else'"),
        (lambda p: _rewrite(p, version=2), "version is 2"),
        (lambda p: _rewrite(p, config={**dataclasses.asdict(TEST_CONFIG), "hidden_size": 48}), "has shape"),
        (lambda p: _rewrite(p, config={**dataclasses.asdict(TEST_CONFIG), "nope": 1}), "does not know"),
        (lambda p: _rewrite(p, state_dict={}), "missing"),
    ],
)
def test_bad_files_are_one_clear_value_error(saved, mutate, message):
    _, path = saved
    mutate(path)
    with pytest.raises(ValueError, match=message) as info:
        load_tiny_lm(path)
    assert str(path) in str(info.value)


def test_round_trip_with_checkpoint_switches(tmp_path):
    config = dataclasses.replace(
        TEST_CONFIG, attention_bias=True, tie_word_embeddings=True, rope_scaling=RopeScaling("llama3", 8.0)
    )
    model = TinyLM(config, seed=2)
    save_tiny_lm(model, tmp_path / "lm.pt", {})
    loaded = load_tiny_lm(tmp_path / "lm.pt")
    assert loaded.cfg == config and loaded.lm_head.weight is loaded.embed_tokens
    ids = torch.tensor([5, 6, 7, 8])
    torch.testing.assert_close(loaded.forward_naive(ids), model.forward_naive(ids), rtol=0, atol=0)
