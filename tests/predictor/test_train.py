"""Training smoke run, checkpoint, wandb modes and `preempt eval-predictor` (one module
fixture trains once; the other tests reuse its checkpoint)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from predictor.data import DataError, PreemptionDataModule, SplitConfig, load_table
from predictor.model import PreemptionLSTM
from predictor.train import TrainConfig, train
from preempt.cli import main
from preempt.obs.tracking import resolve_wandb_mode
from tests.predictor import synthetic_dataset

torch.set_num_threads(1)

METRICS = {
    "auroc",
    "auprc",
    "threshold",
    "precision",
    "recall",
    "f1",
    "mean_lead_time_s",
    "event_recall",
    "event_recall_ahead",
    "num_rows",
    "num_positive",
    "num_predicted",
}


pytestmark = pytest.mark.usefixtures("no_wandb_network")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "features"
    return synthetic_dataset(path, num_requests=300, window=("azure-conv", 1300.0, 200.0))


@pytest.fixture(scope="module")
def trained(data_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    config = TrainConfig(max_epochs=5, batch_size=256, seq_len=4, wandb="disabled", progress=False)
    return out, train(data_path, out, config)


def test_the_checkpoint_records_its_training_window(trained):
    from preempt.bench.early import training_windows_of

    out, _ = trained
    # what `preempt bench early --windows` reads to keep its windows off the training data
    assert training_windows_of(str(out / "predictor.ckpt")) == [
        {"trace": "azure-conv", "start_s": 1300.0, "end_s": 1500.0}
    ]


def _train_loss(model: PreemptionLSTM, data_path) -> float:
    hp = model.hparams
    datamodule = PreemptionDataModule(data_path, split=SplitConfig(hp.split_seed))
    datamodule.setup()
    model.eval()
    with torch.no_grad():
        losses = [model._loss(batch)[0] for batch in datamodule.loader("train")]
    return float(torch.stack(losses).mean())


def test_training_lowers_the_loss_and_writes_the_files(trained, data_path):
    out, metrics = trained
    assert (out / "predictor.ckpt").is_file() and (out / "metrics.json").is_file()
    assert json.loads((out / "metrics.json").read_text())["auroc"] == pytest.approx(metrics["auroc"])
    assert METRICS <= set(metrics) and metrics["split"] == "test"
    best = PreemptionLSTM.load_from_checkpoint(out / "predictor.ckpt", map_location="cpu", weights_only=True)
    torch.manual_seed(0)
    untrained = PreemptionLSTM(**{k: v for k, v in best.hparams.items() if k != "threshold"})
    untrained.set_normalization(best.feature_mean.numpy(), best.feature_std.numpy())
    assert _train_loss(best, data_path) < 0.8 * _train_loss(untrained, data_path)
    # The signal is plain (lowest rank and a nearly full pool): the model must find it.
    assert metrics["auroc"] > 0.8


def test_checkpoint_loads_weights_only_with_everything_online_use_needs(trained):
    out, metrics = trained
    checkpoint = torch.load(out / "predictor.ckpt", map_location="cpu", weights_only=True)
    hp = checkpoint["hyper_parameters"]
    assert hp["threshold"] == pytest.approx(metrics["threshold"])
    assert hp["seq_len"] == 4 and len(hp["feature_names"]) == 8
    state = checkpoint["state_dict"]
    assert state["lstm.weight_ih_l0"].shape == (4 * 64, 8)  # LSTM(8, 64): 4 gates
    assert state["head.weight"].shape == (1, 64)
    assert not torch.equal(state["feature_std"], torch.ones(8))  # fitted, not the default
    model = PreemptionLSTM.load_from_checkpoint(out / "predictor.ckpt", map_location="cpu", weights_only=True)
    probs = model(torch.zeros(3, 4, 8))
    assert probs.shape == (3,) and torch.all((probs > 0) & (probs < 1))


def test_eval_predictor_reports_every_metric_for_every_predictor(trained, data_path, capsys):
    out, metrics = trained
    argv = ["eval-predictor", "--ckpt", str(out / "predictor.ckpt"), "--data", str(data_path)]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert set(report["predictors"]) == {"lstm", "rule", "logreg", "oracle"}
    for name, values in report["predictors"].items():
        assert METRICS <= set(values), name
    assert report["predictors"]["lstm"]["auroc"] == pytest.approx(metrics["auroc"])
    assert report["predictors"]["oracle"]["auroc"] == 1.0 and report["predictors"]["oracle"]["auprc"] == 1.0
    assert report["predictors"]["logreg"]["auroc"] > 0.6
    # which threshold is which, named: the rows' own best-F1, the checkpoint's operating one
    assert report["threshold_rule"].startswith("f1")
    assert report["checkpoint_threshold"] == pytest.approx(metrics["threshold"])
    assert report["checkpoint_threshold_rule"] == metrics["threshold_rule"]
    # the engine's operating point: the LSTM's test scores at the checkpoint's threshold,
    # what `preempt train` reported
    at_checkpoint = report["checkpoint_metrics"]
    for key in ("threshold", "precision", "recall", "f1", "num_predicted"):
        assert at_checkpoint[key] == pytest.approx(metrics[key]), key

    # without --json: a short table, one row per scorer and the operating point
    assert main(argv) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[2:]] == [
        "| lstm",
        "| rule",
        "| logreg",
        "| oracle",
        f"| lstm at its checkpoint's threshold ({metrics['threshold_rule']})",
    ]
    assert "precision" in rows[0] and len(table) < 1500


@pytest.mark.filterwarnings("ignore:The number of training batches")
def test_offline_wandb_writes_a_local_run(data_path, tmp_path):
    assert resolve_wandb_mode(None) == "offline"  # no API key: offline
    config = TrainConfig(max_epochs=1, batch_size=256, seq_len=2, limit_train_batches=2, progress=False)
    metrics = train(data_path, tmp_path, config)
    assert metrics["wandb"] == "offline"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert (tmp_path / "predictor.ckpt").is_file()
    assert metrics["wandb_run_dir"] == str(runs[0])


@pytest.mark.filterwarnings("ignore:The number of training batches")
def test_train_prints_where_the_offline_run_is_and_how_to_upload_it(data_path, tmp_path, capsys):
    args = ["train", "--data", str(data_path), "--out", str(tmp_path), "--max-epochs", "1"]
    assert main([*args, "--seq-len", "2", "--batch-size", "4096", "--wandb", "offline", "--no-progress"]) == 0
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert f"wandb (offline): {run}; upload it with: wandb sync {run}" in capsys.readouterr().out


def test_wandb_mode_resolution(monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode(None) == "online"
    assert resolve_wandb_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="--wandb"):
        resolve_wandb_mode("cloud")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", "d", "--out", "o", "--wandb", "cloud"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--wandb" in err and len(err.splitlines()) == 1


def test_missing_data_or_checkpoint_fails_with_one_line(tmp_path, capsys, trained, data_path):
    out, _ = trained
    with pytest.raises(DataError, match="features dataset not found"):
        train(tmp_path / "nope", tmp_path / "out", TrainConfig(wandb="disabled", progress=False))
    for argv in (
        ["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--wandb", "disabled"],
        ["eval-predictor", "--ckpt", str(tmp_path / "none.ckpt"), "--data", str(data_path)],
        ["eval-predictor", "--ckpt", str(out / "predictor.ckpt"), "--data", str(tmp_path / "nope")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("preempt: error: --") and len(err.splitlines()) == 1, err


def test_distribution_shift_scores_another_dataset_with_the_source_thresholds(trained, data_path, tmp_path):
    from predictor.evaluate import evaluate_checkpoint, render_evaluation

    out, metrics = trained
    other = synthetic_dataset(tmp_path / "other", num_requests=60, seed=5)
    report = evaluate_checkpoint(out / "predictor.ckpt", other, split="all", source=data_path)
    assert f"all rows; thresholds and logreg from {data_path}" in render_evaluation(report)
    assert report["split"] == "all" and report["num_rows"] == len(load_table(other).label)
    lstm = report["predictors"]["lstm"]
    assert lstm["threshold"] == pytest.approx(metrics["threshold"])  # chosen on the source's val
    assert report["predictors"]["oracle"]["auroc"] == 1.0 and lstm["auroc"] > 0.7
    with pytest.raises(ValueError, match="source"):
        evaluate_checkpoint(out / "predictor.ckpt", data_path, split="all")
    argv = ["eval-predictor", "--ckpt", str(out / "predictor.ckpt"), "--data", str(other)]
    assert main([*argv, "--source-data", str(data_path), "--split", "all"]) == 0
    assert main(["eval-predictor", "--ckpt", str(tmp_path / "none.ckpt"), "--data", str(other)]) == 2


def test_two_process_ddp_training_writes_one_checkpoint(data_path, tmp_path):
    """The scale-out path is Lightning's own: `--devices N --strategy ddp` (here two CPU
    processes with ddp_spawn, gloo). Rank 0 alone evaluates and writes the files."""
    out = tmp_path / "ddp"
    config = TrainConfig(
        max_epochs=1,
        batch_size=256,
        seq_len=4,
        wandb="disabled",
        progress=False,
        devices=2,
        strategy="ddp_spawn",
        limit_train_batches=2,
    )
    metrics = train(data_path, out, config)
    assert metrics["config"]["devices"] == 2 and 0.0 <= metrics["auroc"] <= 1.0
    assert (out / "predictor.ckpt").is_file() and json.loads((out / "metrics.json").read_text())[
        "split"
    ] == "test"


@pytest.mark.parametrize("rule", ["waste_capped", "expected_value"])
def test_threshold_on_val_of_a_mix(tmp_path, rule):
    """Two datasets trained as one mix: the operating threshold comes from the val curve
    by the rule (the default: waste capped), the curve it was picked from is in
    metrics.json and the checkpoint holds that threshold."""
    from predictor.evaluate import best_expected_value_threshold, best_waste_capped_threshold
    from preempt.early.online_predictor import load_checkpoint

    first = synthetic_dataset(tmp_path / "a", num_requests=60, seed=1, with_tokens=True)
    second = synthetic_dataset(tmp_path / "b", num_requests=60, seed=1, with_tokens=True)
    mix = f"{first},{second}"
    assert TrainConfig.threshold_rule == "waste_capped"
    config = TrainConfig(
        max_epochs=1, batch_size=256, seq_len=4, wandb="disabled", progress=False, threshold_rule=rule
    )
    metrics = train(mix, tmp_path / "out", config)
    assert metrics["threshold_rule"] == rule
    curve = metrics["threshold_curve"]
    assert len(curve) > 5 and {"precision", "recall", "expected_value_s", "wasted_gb", "waste_share"} <= set(
        curve[0]
    )
    if rule == "waste_capped":
        chosen = best_waste_capped_threshold(curve, TrainConfig.max_waste_share)
    else:
        chosen = best_expected_value_threshold(curve)
    assert math.isfinite(chosen) and metrics["threshold"] == chosen
    _, hparams = load_checkpoint(tmp_path / "out" / "predictor.ckpt")
    assert hparams["threshold"] == chosen
    # the same seed in both: requests must still stay apart (one group per source)
    assert metrics["num_train_rows"] + metrics["num_val_rows"] + metrics["num_test_rows"] == 2 * len(
        load_table(first).label
    )


def test_the_cli_passes_the_threshold_rule_through(data_path, tmp_path, capsys):
    from preempt.cli import main

    out = tmp_path / "f1"
    argv = ["train", "--data", str(data_path), "--out", str(out), "--max-epochs", "1", "--seq-len", "4"]
    assert main([*argv, "--wandb", "disabled", "--no-progress", "--threshold-rule", "f1"]) == 0
    assert json.loads((out / "metrics.json").read_text())["threshold_rule"] == "f1"


def test_a_model_that_would_never_warn_is_an_error_not_a_checkpoint(tmp_path, capsys, monkeypatch):
    """No threshold passes the rule on val: `preempt train` exits 2 naming why and what to
    change, writes the curve to metrics.json for a look, and leaves no checkpoint."""
    import predictor.evaluate

    monkeypatch.setattr(predictor.evaluate, "best_waste_capped_threshold", lambda *args: math.inf)
    data_path = synthetic_dataset(tmp_path / "data", num_requests=60, seed=1, with_tokens=True)
    out = tmp_path / "never"
    argv = ["train", "--data", str(data_path), "--out", str(out), "--max-epochs", "1", "--seq-len", "4"]
    assert main([*argv, "--wandb", "disabled", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no operating threshold" in err and "--max-waste-share" in err and "more windows" in err
    assert not (out / "predictor.ckpt").exists()
    assert json.loads((out / "metrics.json").read_text())["threshold_curve"]
