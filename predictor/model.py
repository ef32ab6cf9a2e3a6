"""The SPEC §8 predictor: LSTM(input_size=8, hidden_size=64) -> Linear(64, 1) -> sigmoid,
read on the last step, as a LightningModule.

Owns: the network, its input standardisation (mean/std buffers fitted on the train split
and saved in the checkpoint, so online use needs nothing but the checkpoint), the loss
(BCE with `pos_weight` for the rare positive class), the optimiser, and the validation
metrics that pick the best checkpoint (val AUPRC).

Must never: see a label inside `forward`, change the architecture the SPEC fixes (extra
capacity belongs in a new class with its own name), or be imported by `preempt/` (the
engine and server must not pay `import pytorch_lightning`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn

from predictor.evaluate import average_precision, roc_auc

NUM_FEATURES = 8
HIDDEN_SIZE = 64


class PreemptionLSTM(pl.LightningModule):
    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        pos_weight: float = 1.0,
        seq_len: int = 16,
        horizon_ms: float = 50.0,
        feature_names: Sequence[str] = (),
        split_seed: int = 0,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        threshold: float = 0.5,
    ) -> None:
        super().__init__()
        # Everything needed to rebuild the data split and to use the model online lives
        # in the checkpoint's hparams (plain types, so weights_only loading works);
        # `threshold` is the operating point, chosen on val after training.
        self.save_hyperparameters()
        self.lstm = nn.LSTM(input_size=NUM_FEATURES, hidden_size=HIDDEN_SIZE, batch_first=True)
        self.head = nn.Linear(HIDDEN_SIZE, 1)
        self.register_buffer("feature_mean", torch.zeros(NUM_FEATURES))
        self.register_buffer("feature_std", torch.ones(NUM_FEATURES))
        self._val_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def set_normalization(self, mean: np.ndarray, std: np.ndarray) -> None:
        self.feature_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.feature_std.copy_(torch.as_tensor(std, dtype=torch.float32))

    # ----------------------------------------------------------------- network
    def logits(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, 8) raw features, oldest step first; mask (B, T) False on padding.
        Returns (B,) logits of the last step."""
        z = (x - self.feature_mean) / self.feature_std  # (B, T, 8)
        if mask is not None:
            z = z * mask.unsqueeze(-1).to(z.dtype)  # padding reads as the train mean
        out, _ = self.lstm(z)  # (B, T, H)
        return self.head(out[:, -1]).squeeze(-1)  # (B,)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """P(preempted within the horizon), (B,)."""
        return torch.sigmoid(self.logits(x, mask))

    # ----------------------------------------------------------------- training
    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(batch["x"], batch["mask"])
        pos_weight = torch.tensor(self.hparams.pos_weight, dtype=logits.dtype)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"], pos_weight=pos_weight)
        return loss, logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.log("val/loss", loss, batch_size=len(batch["label"]))
        self._val_outputs.append((torch.sigmoid(logits).detach(), batch["label"]))

    def on_validation_epoch_start(self) -> None:
        self._val_outputs = []

    def on_validation_epoch_end(self) -> None:
        if not self._val_outputs:
            return
        scores = torch.cat([s for s, _ in self._val_outputs]).numpy()
        labels = torch.cat([y for _, y in self._val_outputs]).numpy()
        self._val_outputs = []
        auprc = average_precision(scores, labels)
        # A NaN (no positive in val) must not win the checkpoint race: report 0.
        self.log("val/auprc", 0.0 if np.isnan(auprc) else auprc)
        auroc = roc_auc(scores, labels)
        self.log("val/auroc", 0.0 if np.isnan(auroc) else auroc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    @torch.no_grad()
    def predict_batches(self, batches) -> np.ndarray:
        """Probabilities for every batch of a loader, in order (eval mode, no grad)."""
        was_training = self.training
        self.eval()
        out = [self(batch["x"], batch["mask"]) for batch in batches]
        self.train(was_training)
        return torch.cat(out).numpy() if out else np.zeros(0, np.float32)
