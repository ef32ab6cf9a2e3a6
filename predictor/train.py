"""Training the preemption predictor: `preempt train --data D2 --out D3`.

Owns: the training run (seeding, the Trainer, the best-val-AUPRC checkpoint at
`D3/predictor.ckpt`, the operating threshold chosen on val, `D3/metrics.json` with the
test metrics) and the one seam to wandb (`preempt.obs.tracking.make_logger`).

Must never: block on the network (wandb is offline unless asked for online or an API key
is set; `disabled` creates no wandb run at all), read test rows before the checkpoint
and threshold are fixed, or run on a GPU by accident (the model is tiny; CPU keeps runs
reproducible and the device free).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from predictor.data import PreemptionDataModule, SplitConfig
from predictor.evaluate import MAX_WASTE_SHARE, evaluate_scores, jsonable
from predictor.model import PreemptionLSTM
from preempt.obs.tracking import make_logger, quiet_lightning, resolve_wandb_mode

CHECKPOINT_NAME = "predictor.ckpt"


@dataclass(frozen=True)
class TrainConfig:
    """Defaults chosen by val AUPRC on the default collect data (preempt/configs/
    collect.yaml, azure-conv; docs/archive/predictor-history.md), (batch_size, max_epochs, seq_len):
    (4096, 6, 64) 0.54, (1024, 6, 64) 0.56, (1024, 12, 64) 0.71, (512, 12, 64) 0.67,
    (1024, 12, 16) 0.55, (1024, 12, 256) 0.72, (1024, 12, whole) 0.69, (2048, 16, 256)
    0.69; one split, so +-0.05 is noise. (1024, 12, 256) fits in ~25 s on one thread."""

    max_epochs: int = 12
    """Passes over the train split."""
    seq_len: int = 256
    """Truncation of backprop through time, in logged steps. The forward pass always runs
    over each request's whole history from its first logged step (as online); gradients
    flow back at most this many steps."""
    batch_size: int = 1024
    """Rows (logged steps, padding included) per batch of whole request histories."""
    lr: float = 1e-2
    """Adam learning rate."""
    gradient_clip: float | None = 1.0
    """Clip the gradient norm (long histories can spike it); None: no clipping."""
    weight_decay: float = 0.0
    seed: int = 0
    """Seeds the split, the initial weights and the shuffle."""
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    wandb: str | None = None
    """online | offline | disabled; None: online if WANDB_API_KEY is set, else offline."""
    threshold_rule: str = "waste_capped"
    """How the operating threshold is chosen on val (predictor.evaluate): `waste_capped`
    (the most save stall avoided with at most `max_waste_share` of the early-copied bytes
    wasted), `expected_value` (stall avoided minus the copy time of wasted bytes, which
    overcharges waste: see predictor.evaluate.WASTE_WEIGHT) or `f1`."""
    max_waste_share: float = MAX_WASTE_SHARE
    """`waste_capped`: the cap on val's share of early bytes wasted."""
    wandb_project: str = "preempt-predictor"
    limit_train_batches: int | float | None = None
    """Cap on train batches per epoch (smoke tests)."""
    num_threads: int | None = 1
    """torch intra-op threads (None: torch's default). One by default: batches of a
    64-unit LSTM are too small to split, and on shared cores a second OpenMP thread made
    each batch ~7x slower (24 ms -> 177 ms, measured on 2 busy cores)."""
    progress: bool = True
    accelerator: str = "cpu"
    """Lightning's `accelerator` (cpu, gpu, auto)."""
    devices: int = 1
    """Lightning's `devices`: processes (CPU) or GPUs that train together."""
    strategy: str = "auto"
    """Lightning's `strategy`, e.g. `ddp` (one process per device) or `ddp_spawn`. Only
    the global-zero process evaluates and writes metrics.json."""
    num_nodes: int = 1
    """Lightning's `num_nodes`: machines, each running `devices` processes (launched by
    torchrun/SLURM, which set MASTER_ADDR, NODE_RANK, ...; docs/experiments.md)."""


def train(data: str | Path, out_dir: str | Path, config: TrainConfig | None = None) -> dict[str, Any]:
    """Train, checkpoint the best val AUPRC to `out_dir/predictor.ckpt`, write and return
    the test metrics (`out_dir/metrics.json`)."""
    config = config or TrainConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    quiet_lightning()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    pl.seed_everything(config.seed, workers=True, verbose=False)

    datamodule = PreemptionDataModule(
        data,
        batch_size=config.batch_size,
        split=SplitConfig(config.seed, config.val_fraction, config.test_fraction),
    )
    datamodule.setup()
    table = datamodule.table
    horizon_ms = float(table.meta.get("horizon_ms", 50.0))
    model = PreemptionLSTM(
        lr=config.lr,
        weight_decay=config.weight_decay,
        pos_weight=datamodule.pos_weight(),
        seq_len=config.seq_len,
        horizon_ms=horizon_ms,
        feature_names=list(table.meta.get("feature_names", [])),
        split_seed=config.seed,
        val_fraction=config.val_fraction,
        test_fraction=config.test_fraction,
        every_k_steps=int(table.meta.get("every_k_steps", 1)),
        horizon_steps=int(table.meta.get("horizon_steps", 0)),
        feature_set=str(table.meta.get("feature_set", "v1")),
        training_windows=list(table.meta.get("windows", [])),
    )
    model.set_normalization(*datamodule.feature_stats())

    checkpoint_path = out_dir / CHECKPOINT_NAME
    if checkpoint_path.exists():
        checkpoint_path.unlink()  # a stale best from an earlier run must not survive
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=str(out_dir),
        filename=Path(CHECKPOINT_NAME).stem,
        monitor="val/auprc",
        mode="max",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    logger = make_logger(config.wandb, out_dir, config.wandb_project, {**asdict(config), "data": str(data)})
    # Trainer(deterministic=True) switches torch's deterministic mode on process-wide (in
    # its constructor) and leaves it on; with it every torch.empty is filled with NaN, so
    # a 4 GB host pool then costs seconds. Restore the caller's setting after training.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    trainer = pl.Trainer(
        max_epochs=config.max_epochs,
        accelerator=config.accelerator,
        devices=config.devices,
        strategy=config.strategy,
        num_nodes=config.num_nodes,
        logger=logger,
        callbacks=[checkpoint],
        deterministic=True,
        enable_progress_bar=config.progress,
        enable_model_summary=False,
        gradient_clip_val=config.gradient_clip,
        limit_train_batches=config.limit_train_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        default_root_dir=str(out_dir),
    )
    fit_started = time.perf_counter()
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
    fit_s = time.perf_counter() - fit_started
    if not trainer.is_global_zero:  # DDP: the other ranks are done once the fit is
        return {}

    # Threshold on val, then (only now) the test rows, with the best checkpoint.
    best = PreemptionLSTM.load_from_checkpoint(str(checkpoint_path), map_location="cpu", weights_only=True)
    rows = datamodule.rows
    val_scores = best.predict_rows(datamodule.loader("val"), rows["val"])
    test_scores = best.predict_rows(datamodule.loader("test"), rows["test"])
    rule = config.threshold_rule
    if rule != "f1" and table.num_tokens is None:
        rule = "f1"  # an older dataset without the bytes per row: F1 it is (metrics say so)
    cap = config.max_waste_share
    test = evaluate_scores(table, rows["val"], rows["test"], val_scores, test_scores, rule, cap)
    val = evaluate_scores(table, rows["val"], rows["val"], val_scores, val_scores, rule, cap)
    val.pop("threshold_curve", None)  # the same curve as test's (both chosen on val)
    if not np.isfinite(test["threshold"]):
        # A checkpoint that never warns would make every early-save arm its parent, silently.
        checkpoint_path.unlink()
        (out_dir / "metrics.json").write_text(json.dumps(jsonable({**test, "val": val}), indent=2) + "\n")
        raise NoThresholdError(_no_threshold_message(test, len(rows["val"]), out_dir))
    _store_threshold(checkpoint_path, test["threshold"], test["threshold_rule"])

    metrics: dict[str, Any] = {
        **test,
        "split": "test",
        "val": val,
        "best_val_auprc": float(checkpoint.best_model_score)
        if checkpoint.best_model_score is not None
        else None,
        "epochs": trainer.current_epoch,
        "num_train_rows": len(rows["train"]),
        "num_val_rows": len(rows["val"]),
        "num_test_rows": len(rows["test"]),
        "train_positive_rate": float(table.label[rows["train"]].mean()),
        "pos_weight": model.hparams.pos_weight,
        "fit_wall_s": fit_s,
        "wall_s": time.perf_counter() - started,
        "data": str(data),
        "config": asdict(config),
        "wandb": resolve_wandb_mode(config.wandb),
        # the run's own folder (offline: what `wandb sync` uploads); None when disabled
        "wandb_run_dir": str(Path(logger.experiment.dir).parent) if logger else None,
    }
    metrics = jsonable(metrics)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if logger:
        logger.log_metrics(
            {f"test/{k}": v for k, v in test.items() if isinstance(v, float) and np.isfinite(v)}
        )
        logger.experiment.finish()
    return metrics


class NoThresholdError(ValueError):
    """Training found no operating threshold on val: the model would never warn."""


def _no_threshold_message(test: dict[str, Any], num_val_rows: int, out_dir: Path) -> str:
    curve = test.get("threshold_curve") or []
    most = max((p.get("warned_epochs", 0) for p in curve), default=0)
    return (
        f"no operating threshold: under the '{test['threshold_rule']}' rule no threshold on val "
        f"({num_val_rows} rows, at most {most} request epochs warned) avoids save stall"
        + (
            f" with at most {test['max_waste_share']:.0%} of early-copied bytes wasted"
            if "max_waste_share" in test
            else ""
        )
        + f", so the model would never warn (its curve is in {out_dir / 'metrics.json'}; "
        "no checkpoint written). "
        "Collect more data (more windows: several `preempt collect` runs, then `--data a,b,c`), "
        "or raise --max-waste-share, or choose --threshold-rule f1"
    )


def _store_threshold(path: Path, threshold: float, rule: str) -> None:
    """Keep the val-chosen operating threshold, and the rule that chose it, with the
    weights, for online use (and for `preempt eval-predictor` to say which it is)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["threshold"] = float(threshold)
    checkpoint["hyper_parameters"]["threshold_rule"] = rule
    torch.save(checkpoint, path)
