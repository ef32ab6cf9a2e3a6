"""The docs/design.md §8 predictor: LSTM(input_size=8, hidden_size=64) -> Linear(64, 1) -> sigmoid,
read on the last step, as a LightningModule.

Sequences are whole request histories from the request's first logged step (see
predictor.data for why): the read-out at step t is the prediction for the row at step t,
and training puts a loss on every step. `seq_len` is the truncation of backprop.

Owns: the network, its input standardisation (mean/std buffers fitted on the train split
and saved in the checkpoint, so online use needs nothing but the checkpoint), the loss
(BCE with `pos_weight` for the rare positive class), the optimiser, and the validation
metrics that pick the best checkpoint (val AUPRC).

Must never: see a label inside `forward`, change the architecture the design fixes (extra
capacity belongs in a new class with its own name), or be imported by `preempt/` (the
engine and server must not pay `import pytorch_lightning`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn

from predictor.metrics import average_precision, roc_auc

NUM_FEATURES = 8
HIDDEN_SIZE = 64


class PreemptionLSTM(pl.LightningModule):
    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        pos_weight: float = 1.0,
        seq_len: int = 64,
        horizon_ms: float = 50.0,
        feature_names: Sequence[str] = (),
        split_seed: int = 0,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        threshold: float = 0.5,
        threshold_rule: str | None = None,
        history: str = "full",
        every_k_steps: int = 1,
        horizon_steps: int = 0,
        feature_set: str = "v1",
        training_windows: Sequence[dict] = (),
    ) -> None:
        super().__init__()
        # Everything needed to rebuild the data split and to use the model online lives
        # in the checkpoint's hparams (plain types, so weights_only loading works);
        # `threshold` is the operating point, chosen on val after training by
        # `threshold_rule` (predictor.evaluate.THRESHOLD_RULES; None: older); `history`
        # says how it was trained: "full" = every step of whole request histories from
        # their first step (predictor.data), as the online predictor runs it. Checkpoints
        # without it were trained on zero-started windows. `every_k_steps`: the data's
        # logging period; online, one LSTM step must stand for the same k engine steps.
        # `horizon_steps` / `feature_set`: the labels' step horizon and the features'
        # set (preempt.early.features.FEATURE_SETS); online, a different one is refused.
        # `training_windows`: the trace windows of its data ({"trace", "start_s", "end_s"},
        # preempt.core.workload.trace_window), so that a bench can refuse to score it on them.
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
    def step_logits(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, 8) raw features of consecutive logged steps, oldest first; `state`
        (h, c), each (1, B, H), carried from the steps before x (None: the zero state of
        a request's first step). Returns the logits of every step (B, T) and the state
        after the last one."""
        z = (x - self.feature_mean) / self.feature_std  # (B, T, 8)
        out, state = self.lstm(z, state)  # (B, T, H)
        return self.head(out).squeeze(-1), state  # (B, T)

    def step_probs(self, x: torch.Tensor) -> torch.Tensor:
        """P(preempted within the horizon) at every step of histories x (B, T, 8) that
        start at the requests' first logged steps: (B, T). Row t is what the online
        predictor returns at step t (preempt.early.online_predictor)."""
        return torch.sigmoid(self.step_logits(x)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The design's read-out, on the last step: P(preempted within the horizon) (B,)
        after histories x (B, T, 8) that start at the requests' first logged steps."""
        return torch.sigmoid(self.step_logits(x)[0][:, -1])

    # ----------------------------------------------------------------- training
    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean BCE over the real (unpadded) steps of a batch of whole histories, with
        backprop truncated every `seq_len` steps: the state flows forward through the
        whole history (as online), gradients through at most `seq_len` steps, which
        bounds the cost and keeps gradients of 1,000-step histories tame."""
        x, mask, label = batch["x"], batch["mask"], batch["label"]  # (B, T, 8), (B, T), (B, T)
        chunk = self.hparams.seq_len
        state = None
        chunks = []
        for start in range(0, x.shape[1], chunk):
            logits, state = self.step_logits(x[:, start : start + chunk], state)
            state = (state[0].detach(), state[1].detach())  # truncated BPTT
            chunks.append(logits)
        logits = torch.cat(chunks, dim=1)  # (B, T)
        pos_weight = torch.tensor(self.hparams.pos_weight, dtype=logits.dtype)
        weight = mask.to(logits.dtype)
        per_step = nn.functional.binary_cross_entropy_with_logits(
            logits, label, pos_weight=pos_weight, reduction="none"
        )
        loss = (per_step * weight).sum() / weight.sum().clamp_min(1.0)
        return loss, logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(batch["mask"].sum()))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        mask = batch["mask"]
        self.log("val/loss", loss, batch_size=int(mask.sum()))
        self._val_outputs.append((torch.sigmoid(logits[mask]).detach(), batch["label"][mask]))

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
    def predict_rows(self, batches, rows: np.ndarray) -> np.ndarray:
        """Probabilities of `rows` (sorted table row indices, e.g. a split), from a loader
        of whole histories that covers them (predictor.data.SequenceBatches); eval mode,
        no grad, whole histories at once (no truncation needed without gradients)."""
        was_training = self.training
        self.eval()
        out = np.full(len(rows), np.nan, dtype=np.float32)
        for batch in batches:
            mask = batch["mask"]
            probs = self.step_probs(batch["x"])[mask].numpy()
            batch_rows = batch["rows"][mask].numpy()
            position = np.searchsorted(rows, batch_rows)
            if np.any(position >= len(rows)) or np.any(
                rows[np.minimum(position, len(rows) - 1)] != batch_rows
            ):
                raise ValueError("predict_rows: a batch holds rows outside `rows` (or `rows` is not sorted)")
            out[position] = probs
        self.train(was_training)
        if np.isnan(out).any():
            raise ValueError("predict_rows: the batches did not cover every row")
        return out
