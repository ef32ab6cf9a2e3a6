"""The command line: one line and exit 2 for every bad value; flags over the config file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from preempt.cli import main as cli_main
from preempt.serve import add_serve_arguments, config_from_args

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ command line
def test_bad_size_flag_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "preempt.cli", "serve", "--preemption-host-mem", "bogus"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--preemption-host-mem" in result.stderr


def test_config_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from preempt.server import main as server_main

    assert server_main(["--preemption-host-mem", "1MB", "--preemption-slot-size", "2MB"]) == 2
    assert cli_main(["serve", "--model", "no-such-model"]) == 2
    virtual = tmp_path / "virtual.json"
    virtual.write_text('{"clock": {"kind": "virtual"}}')
    assert cli_main(["serve", "--config", str(virtual)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert "preemption" in err[0] and "--model" in err[1] and "clock.kind" in err[2]


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "serve.yaml"
    path.write_text("preemption:\n  host_mem: 1GB\n  slot_size: 64MB\n  max_preemption_per_min: 5\n")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--config", str(path), "--preemption-host-mem", "2GiB", "--set", "scheduler.max_num_seqs=3"]
    )
    config = config_from_args(args)
    assert config.preemption.host_mem == 2 * 2**30 and config.preemption.slot_size == 64 * 10**6
    assert config.preemption.max_preemption_per_min == 5 and config.scheduler.max_num_seqs == 3
    assert config.clock.kind == "wall" and config.model.preset == "tiny-2l"


def test_serve_config_json_is_the_specs_example() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    shipped = REPO / "preempt" / "configs" / "serve_config.json"
    config = config_from_args(parser.parse_args(["--config", str(shipped)]))
    p = config.preemption
    assert p.time_slice_strategy == "dynamic" and p.min_time_slice_ms == 10
    assert (p.priority_weights.age, p.priority_weights.sla, p.priority_weights.tokens) == (1.2, 0.8, 0.5)
    assert p.max_preemption_per_min == 30
