"""Which weights `preempt serve` serves: the reference LM of `make run` by default when it
exists, the user's own choice otherwise, and a startup line that says which (random weights
as a WARNING that says how to get trained ones)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from preempt.core.config import EngineConfig
from preempt.model.checkpoint import save_tiny_lm
from preempt.model.tiny import PRESETS, TinyLM
from preempt.serve import add_serve_arguments, config_from_args
from preempt.serve.weights import reference_lm_path
from tests.serve.conftest import running_server, serve_config


def _config(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def _save_lm(path: Path) -> None:
    save_tiny_lm(TinyLM(PRESETS["tiny-2l"], seed=7), path, {"note": "test"})


def test_the_reference_lm_is_served_by_default_once_make_run_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _config([]).model.checkpoint is None  # no `make run` here: random weights
    assert not reference_lm_path().is_absolute()  # found from the working directory
    _save_lm(reference_lm_path())
    assert _config([]).model.checkpoint == str(reference_lm_path())
    # The shipped serve config chooses no model: it serves the reference LM too.
    shipped = Path(__file__).resolve().parents[2] / "preempt" / "configs" / "serve_config.json"
    assert _config(["--config", str(shipped)]).model.checkpoint == str(reference_lm_path())
    # A model the user chose is served as chosen, never replaced by the reference LM.
    mine = tmp_path / "mine.pt"
    assert _config(["--set", f"model.checkpoint={mine}"]).model.checkpoint == str(mine)
    assert _config(["--set", "model.checkpoint=null"]).model.checkpoint is None
    assert _config(["--model", "tiny-2l"]).model.checkpoint is None
    assert _config(["--set", "model.backend=null"]).model.checkpoint is None
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("model:\n  preset: small-4l\n")
    assert _config(["--config", str(config_file)]).model.checkpoint is None


def _startup_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "preempt.server" and "serving" in r.getMessage()]


def test_startup_line_warns_about_random_weights(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="preempt.server")
    with running_server(serve_config()):
        pass
    [record] = _startup_records(caplog)
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "RANDOM weights" in message and "random bytes" in message
    assert "'make run'" in message and str(reference_lm_path()) in message
    assert "--set model.checkpoint=PATH" in message


def test_startup_line_names_the_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "lm.pt"
    _save_lm(path)
    caplog.set_level(logging.INFO, logger="preempt.server")
    with running_server(serve_config(model={"checkpoint": str(path)})):
        pass
    [record] = _startup_records(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == f"serving trained weights: {path} (a preempt lm train checkpoint)"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
