"""The `preempt` command line: contract files, reproducibility, one-line errors."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from preempt.cli import main

CONTRACT_COLUMNS = {
    "request_id",
    "arrival_s",
    "prompt_tokens",
    "max_tokens",
    "output_tokens",
    "sla_level",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "num_preemptions",
    "final_state",
    "output_digest",
}
CONTRACT_KEYS = {
    "num_requests",
    "num_finished",
    "num_preemptions",
    "num_preemption_failed",
    "preemption_stall_s",
    "kv_saved_bytes_raw",
    "kv_saved_bytes_stored",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "goodput_req_s",
    "per_sla",
    "sim_time_s",
    "wall_time_s",
    "config",
}
# 15 s of the bundled conversation trace at 4x (24 requests) on the tiny model, one thread.
SMALL = ["--trace", "azure-conv", "--duration", "15", "--rate-scale", "4", "--no-progress",
         "--set", "cache.num_blocks=1200", "--set", "model.max_model_len=8192",
         "--set", "model.num_threads=1"]  # fmt: skip


def test_run_writes_contract_files(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "a"), *SMALL]) == 0
    table = pq.read_table(tmp_path / "a" / "requests.parquet")
    assert CONTRACT_COLUMNS <= set(table.column_names)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert CONTRACT_KEYS <= set(summary)
    assert summary["num_requests"] == table.num_rows == 24
    assert summary["num_finished"] + summary["num_aborted"] == summary["num_requests"]
    assert summary["config"]["cache"]["num_blocks"] == 1200
    assert set(table.column("final_state").to_pylist()) <= {"FINISHED", "ABORTED"}
    out = capsys.readouterr().out
    assert "requests.parquet" in out
    assert '"workload": "azure-conv [0 s, 15 s) at 4x its rate, max_tokens fixed at 1024"' in out


def test_run_names_the_window_and_rate_a_config_file_brings(tmp_path, capsys):
    """A user's --trace with engine_quick.yaml replays that file's 60 s at 4x: said so."""
    argv = ["run", "--config", "preempt/configs/engine_quick.yaml", "--trace", "azure-code"]
    assert main([*argv, "--duration", "5", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    line = json.loads(capsys.readouterr().out.rsplit("\nwrote", 1)[0])["workload"]
    assert line == (
        "azure-code [0 s, 5 s) at 4x its rate, max_tokens fixed at 1024 "
        "(workload.rate_scale=4.0, workload.max_tokens_mode=fixed from preempt/configs/engine_quick.yaml)"
    )


def test_same_config_and_seed_give_byte_identical_parquet(tmp_path):
    for name in ("a", "b"):
        assert main(["run", "--out", str(tmp_path / name), *SMALL, "--seed", "3"]) == 0
    assert (tmp_path / "a" / "requests.parquet").read_bytes() == (
        tmp_path / "b" / "requests.parquet"
    ).read_bytes()
    assert main(["run", "--out", str(tmp_path / "c"), *SMALL, "--seed", "4"]) == 0
    assert (tmp_path / "a" / "requests.parquet").read_bytes() != (
        tmp_path / "c" / "requests.parquet"
    ).read_bytes()


def test_swap_runs_are_reproducible_too(tmp_path):
    design = ["--set", "scheduler.policy=priority_score", "--set", "preemption.mode=swap_zstd",
              "--set", "cache.num_blocks=200", "--seed", "5"]  # fmt: skip
    for name in ("a", "b"):
        assert main(["run", "--out", str(tmp_path / name), *SMALL, *design]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["num_preemptions"] > 0 and summary["kv_saved_bytes_raw"] > 0
    for file in ("requests.parquet", "preemptions.parquet"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--out", "x", "--set", "scheduler.nope=1"], "unknown config key 'scheduler.nope'"),
        (
            [
                "run",
                "--out",
                "x",
                "--set",
                "preemption.codecs.mixed.fp8_share=0.8",
                "--set",
                "preemption.codecs.mixed.drop_share=0.5",
            ],
            "codec 'mixed': fp8_share + drop_share must be <= 1",
        ),
        (
            [
                "run",
                "--out",
                "x",
                "--set",
                "preemption.mode=swap",
                "--set",
                "early_save.policy=oracle",
                "--set",
                "early_save.oracle_log=missing.parquet",
            ],
            "early_save.oracle_log",
        ),
        (["run", "--out", "x", "--rate-scale", "-1"], "workload.rate_scale"),
        (["run", "--out", "x", "--trace", "no-such-trace"], "no-such-trace"),
        (["run", "--out", "x", "--config", "missing.yaml"], "config file not found"),
        (["run", "--out", "x", "--duration", "soon"], "--duration"),
        (["run"], "--out"),
        (["fly"], "invalid choice"),
        (["train", "--data", "d", "--out", "o", "--threshold-rule", "best"], "--threshold-rule"),
        (
            ["bench", "engine", "--no-served-speed"],
            "preempt bench engine: error: unrecognized arguments: --no-served-speed",
        ),
        (["bench", "codec", "--windows"], "preempt bench codec: error: unrecognized arguments: --windows"),
        (["bench", "fidelity", "--vidur"], "preempt bench fidelity: error: unrecognized arguments: --vidur"),
        (["bench", "vllm", "--shape", "mixed"], "--shape applies to `bench vllm --http` only"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        (["bench", "early", "--windows", "--arms", "lstm"], "--windows with lstm arms needs --model"),
        (
            ["bench", "early", "--windows", "--lengths", "missing.json"],
            "--lengths: no such file: missing.json",
        ),
        (["bench", "early", "--windows", "--modes", "pause", "--arms", "rule"], "--modes: choose from swap"),
        (["bench", "early", "--trace", "azure-code"], "--trace applies to `bench early --windows` only"),
        (["bench", "early", "--windows", "--model", __file__, "--trace", "mooncake"], "trace 'mooncake'"),
        (["bench", "early", "--arms", "lstm"], "--arms applies to `bench early --windows` only"),
        (["bench", "early", "--windows", "--model", __file__, "--arms", "nope"], "--arms: choose from"),
        # every checkpoint of the list is checked (this file exists; b.ckpt does not)
        (["bench", "early", "--windows", "--model", f"{__file__},b.ckpt"], "--model: no such file: b.ckpt"),
        (["train", "--data", "d", "--out", "o", "--max-waste-share", "1.5"], "--max-waste-share"),
        (["tune", "--out", "o"], "--config"),
        (["tune", "--config", "c.yaml"], "--out"),
        (["tune", "--config", "c.yaml", "--out", "o", "--trials", "0"], "--trials"),
        (["tune", "--config", "c.yaml", "--out", "o", "--jobs", "-2"], "--jobs"),
        (["tune", "--config", "c.yaml", "--out", "o", "--wandb", "sometimes"], "--wandb"),
        (["tune", "--config", "c.yaml", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
        (["tune", "--config", "missing.yaml", "--out", "o"], "config file not found: missing.yaml"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_cli_runs_without_the_server_packages_and_serve_names_what_is_missing(monkeypatch, capsys):
    """The offline GPU machine has no fastapi/uvicorn: calibrate and bench must still parse
    and run there, and `serve` must say what is missing rather than the CLI failing whole."""
    import sys

    monkeypatch.setitem(sys.modules, "preempt.serve", None)  # importing it raises ImportError
    assert main(["bench", "clock", "--quick", "--json"]) == 0
    capsys.readouterr()
    assert main(["serve", "--port", "1"]) == 2
    assert "preempt serve needs preempt.serve" in capsys.readouterr().err
