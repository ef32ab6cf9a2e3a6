"""`preempt lm train`: a Lightning smoke run on a small corpus, its files, the cache and
the CLI's errors (one module fixture trains once; the other tests reuse it)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from preempt.cli import main
from preempt.lm import evaluate
from preempt.lm.corpus import Corpus, CorpusConfig, tile_windows
from preempt.lm.train import LMTrainConfig, cached_metrics, lr_factor, train_lm
from preempt.model.checkpoint import checkpoint_meta, load_tiny_lm
from preempt.model.tiny import TinyLM
from tests.lm import TEST_ARCH, write_corpus

torch.set_num_threads(1)


pytestmark = pytest.mark.usefixtures("no_wandb_network")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = write_corpus(tmp_path_factory.mktemp("corpus"))
    return LMTrainConfig(
        arch=TEST_ARCH,
        seq_len=32,
        batch_size=8,
        max_steps=40,
        lr=1e-2,
        warmup_steps=5,
        val_every=20,
        val_bytes=1024,
        eval_bytes=2048,
        corpus=CorpusConfig(root=str(root), val_percent=20, test_percent=20),
        wandb="offline",
        progress=False,
        num_threads=1,
    )


@pytest.fixture(scope="module")
def trained(config, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    return out, train_lm(out, config)


def test_training_learns_and_writes_its_files(trained, config):
    out, metrics = trained
    assert not metrics["cached"] and metrics["completed"] and metrics["steps"] == 40
    assert metrics["tokens_seen"] == 40 * 8 * 32
    corpus = Corpus(config.corpus)
    windows = tile_windows(corpus.stream("test"), 33, config.eval_bytes)
    untrained = evaluate(TinyLM(config.model_config, seed=config.seed), windows)
    assert metrics["test_bpb"] < untrained.bpb - 1.0 and metrics["test_bpb"] < 6.0
    model = load_tiny_lm(out / "lm.pt")
    assert math.isclose(evaluate(model, windows).bpb, metrics["test_bpb"], rel_tol=1e-6)
    meta = checkpoint_meta(out / "lm.pt")
    assert meta["config_key"] == config.key()
    assert meta["corpus"]["python_version"] and meta["corpus"]["num_bytes"]["train"] > 0
    report = json.loads((out / "metrics.json").read_text())
    assert {"test_bpb", "val_bpb", "train_wall_s", "steps", "tokens_seen", "corpus"} <= set(report)
    assert (out / "checkpoints" / "last.ckpt").is_file()  # Lightning's own checkpoint
    assert any((out / "wandb").iterdir())  # offline wandb run under DIR
    assert not torch.are_deterministic_algorithms_enabled()  # restored after Trainer(deterministic=True)


def test_same_config_is_cached_and_another_is_not(trained, config):
    out, metrics = trained
    again = train_lm(out, config)
    assert again["cached"] and again["test_bpb"] == metrics["test_bpb"]
    # Logging and threads do not change the weights: still cached.
    assert cached_metrics(out, LMTrainConfig(**{**config.__dict__, "wandb": "disabled", "num_threads": 2}))
    assert cached_metrics(out, LMTrainConfig(**{**config.__dict__, "max_steps": 41})) is None
    assert cached_metrics(out, LMTrainConfig(**{**config.__dict__, "seed": 1})) is None


def test_cli_trains_then_reports_cached(tmp_path, monkeypatch, capsys):
    # The default corpus is "this Python's stdlib": point it at a small tree.
    root = write_corpus(tmp_path / "stdlib", num_files=60)
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"stdlib": str(root)})
    arch = ["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
    argv = ["lm", "train", "--out", str(tmp_path / "lm"), *arch, "--intermediate", "32", "--seq-len", "16",
            "--batch-size", "4", "--max-steps", "3", "--wandb", "disabled", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "cached" not in first.splitlines()[0] and (tmp_path / "lm" / "lm.pt").is_file()
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert second.startswith("cached: ")
    assert (
        json.loads(second[second.index("{") :])["test_bpb"]
        == json.loads(first[first.index("{") : first.rindex("}") + 1])["test_bpb"]
    )


def test_lr_schedule_warms_up_then_decays():
    config = LMTrainConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(step, config) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert lr_factor(100, config) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "huge"], "unknown LM preset 'huge'"),
        (["--heads", "6", "--kv-heads", "4"], "must be a multiple"),
        (["--max-minutes", "-1"], "max_minutes must be > 0"),
    ],
)
def test_cli_bad_config_is_one_line(tmp_path, capsys, argv, message):
    assert main(["lm", "train", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "lm.pt").exists()


def test_cli_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["lm", "train", "--max-steps", "0"])
    assert info.value.code == 2
    assert "--max-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lm"])
