"""Training the reference LM: `preempt lm train --out DIR`.

Owns: the run's config (`LMTrainConfig`, its architecture presets and its cache key), the
Lightning module around `TinyLM` (next-byte cross-entropy, AdamW, linear warm-up then
cosine decay), the seeded window sampler, the cache check, and the outputs:
`DIR/lm.pt` (`save_tiny_lm`, meta = config, corpus fingerprint, metrics),
`DIR/metrics.json`, `DIR/checkpoints/last.ckpt` (Lightning) and `DIR/wandb/`.

Must never: import Lightning at module level (the CLI's parser and `preempt.lm.importance`
import this module's neighbours), retrain when `DIR/lm.pt` already holds a model of the
same config (the main job calls this every time), read the test split before training
ends, block on the network (wandb is offline unless asked; the seam is
`preempt.obs.tracking.make_logger`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from preempt.lm import evaluate, next_byte_loss
from preempt.lm.corpus import Corpus, CorpusConfig, tile_windows
from preempt.model.checkpoint import checkpoint_meta, save_tiny_lm
from preempt.model.tiny import PRESETS, TinyConfig, TinyLM
from preempt.obs.tracking import quiet_lightning, resolve_wandb_mode

LM_FILE = "lm.pt"
DEFAULT_LM_DIR = Path("runs/lm")
"""The reference LM's folder unless told otherwise, relative to the working directory:
`make run` and `preempt lm train` write DEFAULT_LM_DIR / LM_FILE, and `preempt serve`
serves it when it exists."""

# Bump when a change to this module changes the model a config produces: the cache key
# includes it, so stale `lm.pt` files are retrained instead of trusted.
TRAIN_VERSION = 1

ARCH_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")


@dataclass(frozen=True)
class LMTrainConfig:
    """One training run. Defaults: 500 steps x 16 x 256 = 2.05M training bytes (~3 min at
    the ~11k bytes/s of 2 free cores; ~5 min on one)."""

    preset: str = "lm-4l"
    """Architecture (lm-4l, or an engine preset: tiny-2l, small-4l)."""
    arch: dict[str, int] = field(default_factory=dict)
    """Overrides of the preset's fields (num_layers, hidden_size, num_heads, ...)."""
    seq_len: int = 256
    """Bytes of context per training window."""
    batch_size: int = 16
    max_steps: int = 500
    """Optimizer steps (the schedule's length)."""
    max_minutes: float | None = 15.0
    """Wall-clock cap; a run it stops keeps its weights and says so in metrics.json."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 30
    weight_decay: float = 0.1
    """On weight matrices only (not embeddings or norm gains)."""
    grad_clip: float = 1.0
    seed: int = 0
    """Seeds the initial weights and the training windows."""
    val_every: int = 100
    """Validation every N steps (also the Lightning checkpoint's period)."""
    val_bytes: int = 32_768
    """Bytes of the val split scored during training."""
    eval_bytes: int = 131_072
    """Bytes of the test (and val) split scored at the end: the reported bits/byte."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    wandb: str | None = None
    """online | offline | disabled; None: online if WANDB_API_KEY is set, else offline."""
    wandb_project: str = "preempt-lm"
    num_threads: int | None = None
    """torch intra-op threads (None: torch's default, all cores)."""
    progress: bool = True

    def __post_init__(self) -> None:
        presets = PRESETS
        if self.preset not in presets:
            raise ValueError(f"unknown LM preset '{self.preset}'; valid: {', '.join(sorted(presets))}")
        unknown = sorted(set(self.arch) - set(ARCH_FIELDS))
        if unknown:
            raise ValueError(f"unknown architecture field(s) {unknown}; valid: {', '.join(ARCH_FIELDS)}")
        for name in ("seq_len", "batch_size", "max_steps", "val_every", "val_bytes", "eval_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.lr <= 0:
            raise ValueError("need lr > 0, warmup_steps >= 0 and min_lr_ratio in [0, 1]")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        self.model_config  # noqa: B018 -- validates the architecture now

    @property
    def model_config(self) -> TinyConfig:
        base = PRESETS[self.preset]
        return dataclasses.replace(base, **self.arch) if self.arch else base

    def key(self) -> str:
        """The cache key: a hash of everything that decides the weights and the reported
        numbers (not logging, threads or the progress bar), the code version and the
        Python whose stdlib is the corpus."""
        decisive = {k: v for k, v in asdict(self).items() if k not in _NOT_DECISIVE}
        decisive.update(
            model=asdict(self.model_config),
            corpus_root=str(self.corpus.resolved_root),
            python=_python_version(),
            train_version=TRAIN_VERSION,
        )
        return hashlib.sha256(json.dumps(decisive, sort_keys=True, default=str).encode()).hexdigest()[:16]


_NOT_DECISIVE = {"wandb", "wandb_project", "num_threads", "progress", "val_every", "val_bytes"}


def _python_version() -> str:
    import platform

    return platform.python_version()


def lr_factor(step: int, config: LMTrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step`: linear warm-up, cosine decay."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WindowDataset(torch.utils.data.Dataset):
    """Training windows (T+1 bytes) at offsets drawn once from the seed: the data order
    is a pure function of (corpus, seed, steps), independent of Lightning's RNG use."""

    def __init__(self, stream: np.ndarray, starts: np.ndarray, length: int) -> None:
        self.stream, self.starts, self.length = stream, starts, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return torch.from_numpy(self.stream[start : start + self.length].astype(np.int64))


def _lightning_module(model: TinyLM, config: LMTrainConfig) -> Any:
    """The LightningModule around `model` (built here: Lightning is imported lazily)."""
    import pytorch_lightning as pl

    class ByteLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model.requires_grad_(True)
            self.save_hyperparameters(
                {"model": asdict(model.cfg), "train": asdict(config)}  # plain dicts: weights_only loads
            )

        def training_step(self, windows: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.model.train()
            loss = next_byte_loss(self.model, windows).mean()
            self.log("train/loss", loss, prog_bar=False)
            self.log("train/bpb", loss / math.log(2), prog_bar=True)
            self.log("lr", self.optimizers().param_groups[0]["lr"])
            return loss

        def validation_step(self, windows: torch.Tensor, batch_idx: int) -> None:
            loss = next_byte_loss(self.model, windows).mean()
            self.log("val/loss", loss, batch_size=windows.shape[0])
            self.log("val/bpb", loss / math.log(2), prog_bar=True, batch_size=windows.shape[0])

        def configure_optimizers(self) -> Any:
            decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2 and n != "embed_tokens"]
            rest = [p for n, p in self.model.named_parameters() if p.dim() < 2 or n == "embed_tokens"]
            optimizer = torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": config.weight_decay},
                    {"params": rest, "weight_decay": 0.0},
                ],
                lr=config.lr,
                betas=(0.9, 0.95),
            )
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return ByteLM()


def cached_metrics(out_dir: str | Path, config: LMTrainConfig) -> dict[str, Any] | None:
    """The stored metrics when `out_dir/lm.pt` holds a model of this config, else None
    (absent, unreadable or another config: the caller trains and overwrites)."""
    path = Path(out_dir) / LM_FILE
    if not path.is_file():
        return None
    try:
        meta = checkpoint_meta(path)
    except ValueError:
        return None
    if meta.get("config_key") != config.key():
        return None
    return dict(meta.get("metrics", {}))


def train_lm(
    out_dir: str | Path, config: LMTrainConfig | None = None, *, force: bool = False
) -> dict[str, Any]:
    """Train (unless cached and not `force`), write `lm.pt` and `metrics.json`, return
    the metrics; `metrics["cached"]` says whether this call trained."""
    config = config or LMTrainConfig()
    out_dir = Path(out_dir)
    if not force:
        cached = cached_metrics(out_dir, config)
        if cached is not None:
            return {**cached, "cached": True}

    import pytorch_lightning as pl  # ~5 s; only when training

    from preempt.obs.tracking import make_logger

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    quiet_lightning()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    pl.seed_everything(config.seed, workers=True, verbose=False)

    corpus = Corpus(config.corpus)
    corpus_info = corpus.info()
    length = config.seq_len + 1
    train_stream = corpus.stream("train")
    starts = np.random.default_rng([config.seed, 1]).integers(
        0, train_stream.size - length + 1, size=config.max_steps * config.batch_size
    )
    train_loader = torch.utils.data.DataLoader(
        WindowDataset(train_stream, starts, length), batch_size=config.batch_size, shuffle=False
    )
    val_windows = torch.from_numpy(tile_windows(corpus.stream("val"), length, config.val_bytes))
    val_loader = torch.utils.data.DataLoader(val_windows, batch_size=32, shuffle=False)

    model = TinyLM(config.model_config, seed=config.seed, dtype=torch.float32)
    module = _lightning_module(model, config)
    module.train()  # TinyLM starts in eval mode; Lightning warns about (and keeps) that mode
    checkpoint_dir = out_dir / "checkpoints"
    for stale in checkpoint_dir.glob("*.ckpt"):  # an earlier run's checkpoint must not pose as this one's
        stale.unlink()
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=str(checkpoint_dir), save_last=True, save_top_k=0, every_n_train_steps=config.val_every
    )
    logger = make_logger(
        config.wandb, out_dir, config.wandb_project, {**asdict(config), "config_key": config.key()}
    )
    # Trainer(deterministic=True) turns torch's deterministic mode on process-wide and
    # leaves it on (see predictor.train): restore the caller's setting afterwards.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    trainer = pl.Trainer(
        max_steps=config.max_steps,
        max_epochs=1,
        max_time={"minutes": config.max_minutes} if config.max_minutes is not None else None,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[checkpoint],
        deterministic=True,
        gradient_clip_val=config.grad_clip,
        val_check_interval=min(config.val_every, config.max_steps),
        num_sanity_val_steps=0,
        enable_progress_bar=config.progress,
        enable_model_summary=False,
        log_every_n_steps=10,
        default_root_dir=str(out_dir),
    )
    fit_started = time.perf_counter()
    try:
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
    fit_s = time.perf_counter() - fit_started

    # Only now the test split, with the final weights.
    model.requires_grad_(False).eval()
    test = evaluate(model, tile_windows(corpus.stream("test"), length, config.eval_bytes))
    val = evaluate(model, tile_windows(corpus.stream("val"), length, config.eval_bytes))
    steps = int(trainer.global_step)
    metrics: dict[str, Any] = {
        "test_bpb": test.bpb,
        "test_loss": test.loss,
        "test_bytes": test.num_bytes,
        "val_bpb": val.bpb,
        "val_loss": val.loss,
        "val_bytes": val.num_bytes,
        "steps": steps,
        "completed": steps >= config.max_steps,
        "tokens_seen": steps * config.batch_size * config.seq_len,
        "train_wall_s": fit_s,
        "tokens_per_s": steps * config.batch_size * config.seq_len / fit_s if fit_s > 0 else None,
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - started,
        "wandb": resolve_wandb_mode(config.wandb),
    }
    meta = {
        "config_key": config.key(),
        "train_config": json.loads(json.dumps(asdict(config), default=str)),
        "corpus": corpus_info,
        "metrics": metrics,
        "torch_version": str(torch.__version__),
    }
    save_tiny_lm(model, out_dir / LM_FILE, meta)
    report = {**metrics, "corpus": corpus_info, "config": meta["train_config"], "config_key": config.key()}
    (out_dir / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    if logger:
        logger.log_metrics(
            {"test/bpb": test.bpb, "test/loss": test.loss, "final_val/bpb": val.bpb}, step=steps
        )
        logger.experiment.finish()
    return {**metrics, "cached": False}
