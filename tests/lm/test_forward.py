"""The batched training forward against `TinyLM.forward_naive` (the reference)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from preempt.lm import evaluate, forward_batch, next_byte_loss
from preempt.model.tiny import RopeScaling, TinyLM
from tests.lm import TEST_CONFIG

torch.set_num_threads(1)


def _inputs(batch=3, length=17, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_match_forward_naive():
    model = TinyLM(TEST_CONFIG, seed=1, dtype=torch.float64)
    ids = _inputs()
    gates = torch.rand(TEST_CONFIG.num_layers, TEST_CONFIG.num_heads, dtype=torch.float64)
    for head_gates in (None, gates):
        batched = forward_batch(model, ids, head_gates)
        for b in range(ids.shape[0]):
            torch.testing.assert_close(batched[b], model.forward_naive(ids[b], head_gates))


def test_per_sequence_gate_gradients_match_forward_naive():
    model = TinyLM(TEST_CONFIG, seed=1, dtype=torch.float64)
    windows = _inputs(length=18)
    cfg = TEST_CONFIG
    gates = torch.ones(3, cfg.num_layers, cfg.num_heads, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(next_byte_loss(model, windows, gates).sum(), gates)
    for b in range(3):
        xi = torch.ones(cfg.num_layers, cfg.num_heads, dtype=torch.float64, requires_grad=True)
        loss = F.cross_entropy(model.forward_naive(windows[b, :-1], xi), windows[b, 1:])
        (expected,) = torch.autograd.grad(loss, xi)
        torch.testing.assert_close(grad[b], expected)


def test_evaluate_reports_bits_per_byte():
    model = TinyLM(TEST_CONFIG, seed=1)
    windows = _inputs(batch=5, length=9)
    held = evaluate(model, windows, batch_size=2)
    assert held.num_bytes == 40
    assert math.isclose(held.bpb, held.loss / math.log(2))
    assert math.isclose(held.loss, float(next_byte_loss(model, windows).mean()), rel_tol=1e-5)


def test_checkpoint_switches_match_forward_naive():
    config = dataclasses.replace(
        TEST_CONFIG,
        attention_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling("linear", 2.0),
    )
    model = TinyLM(config, seed=1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases start at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))
    ids = _inputs(batch=2)
    batched = forward_batch(model, ids)
    for b in range(2):
        torch.testing.assert_close(batched[b], model.forward_naive(ids[b]))
