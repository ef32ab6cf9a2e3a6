"""The main job in miniature (preempt/cli/main_job.py's steps 3-5): `preempt collect` on a
training window, `preempt train` with its defaults (the threshold rule included), then the
early-save arm against its parent. The trained predictor must act: `early_lstm` saves
early and so differs from `swap_mixed`; a checkpoint that never warned would make them
identical (what a fresh `make run` once did)."""

from __future__ import annotations

import json

import pytest

from experiments.ablate import ablate
from preempt.cli import main

pytestmark = pytest.mark.usefixtures("no_wandb_network")


def test_collect_train_and_the_early_arm_saves_early(tmp_path):
    features = tmp_path / "features"
    collect = ["collect", "--config", "preempt/configs/collect.yaml", "--no-progress"]
    window = ["--set", "workload.start_s=1300", "--set", "workload.duration_s=100"]
    assert main([*collect, *window, "--out", str(tmp_path / "collect"), "--features", str(features)]) == 0
    out = tmp_path / "predictor"
    train = ["train", "--data", str(features), "--out", str(out), "--wandb", "disabled", "--no-progress"]
    assert main([*train, "--max-epochs", "4"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["threshold"] is not None and metrics["num_predicted"] > 0

    result = ablate(
        "preempt/configs/quick.yaml",
        tmp_path / "ablate",
        wandb="disabled",
        jobs=1,
        predictor=str(out / "predictor.ckpt"),
        only=["swap_mixed", "early_lstm"],
        overrides=["workload.duration_s=30"],  # half of each seed's minute
        plots=False,
        log=lambda _: None,
    )
    runs = {(row["arm"], row["seed"]): row for row in result.rows}
    early = [runs["early_lstm", seed] for seed in range(5)]
    parent = [runs["swap_mixed", seed] for seed in range(5)]
    assert sum(row["num_early_saves"] for row in early) > 0
    assert sum(row["early_bytes_used"] for row in early) > 0  # some early bytes were claimed
    assert all(row["num_early_saves"] == 0 for row in parent)
    assert [row["preemption_stall_save_s"] for row in early] != [
        row["preemption_stall_save_s"] for row in parent
    ]
