"""Baselines the LSTM must beat, scored on the same rows and in the same way.

Owns: three predictors of "preempted within the horizon", each a function from a
`FeatureTable` (plus the train rows, where it fits something) to one score per row:
- `rule`: what the scheduler itself would do next. Among the requests running at a step
  whose time slice is used up (slice_usage >= 1: the priority trigger's candidates), the
  one with the lowest priority score (feature `score_rank`; docs/design.md §1) is the
  next victim. Score = 1 / (1 + rank)
  among those candidates (1.0 for the lowest), 0 for requests still inside their slice.
  Uses the whole running set of the step (other requests' features are present state,
  not the future).
- `logreg`: logistic regression on the last step's 8 standardised features (torch,
  full-batch L-BFGS, the same `pos_weight` as the LSTM), fitted on train rows only.
- `oracle`: the label itself. Not a predictor: the upper bound every metric can reach,
  kept to show the metrics are wired right (AUROC = AUPRC = 1).

Must never: fit on val/test rows, or read `time_to_preemption_s` (except the oracle,
which reads the label on purpose and says so in its name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from predictor.data import FeatureTable
from preempt.early.features import FEATURE_NAMES


def _column(table: FeatureTable, name: str) -> np.ndarray:
    names = table.meta.get("feature_names", list(FEATURE_NAMES))
    return table.features[:, names.index(name)].astype(np.float64)


def rule_scores(table: FeatureTable) -> np.ndarray:
    """1 / (1 + rank by priority score among the slice-used requests of the row's step).

    `score_rank` orders all running requests by score, so it orders any subset too."""
    names = table.meta.get("feature_names", list(FEATURE_NAMES))
    # The scale-free set's rank_share is score_rank / (running - 1): the same order in a step.
    score = _column(table, "score_rank" if "score_rank" in names else "rank_share")
    is_candidate = _column(table, "slice_usage") >= 1.0
    out = np.zeros(len(score), dtype=np.float64)
    rows = np.flatnonzero(is_candidate)
    # Rank within each step (and run, and dataset of a mix): sort by (step key, score),
    # count from each key's start.
    source = table.source if table.source is not None else np.zeros_like(table.seed)
    _, step_key = np.unique(
        np.stack([source[rows], table.seed[rows], table.step[rows]], axis=1), axis=0, return_inverse=True
    )
    step_key = step_key.reshape(-1)
    order = np.lexsort((score[rows], step_key))
    sorted_key = step_key[order]
    is_start = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
    start = np.maximum.accumulate(np.where(is_start, np.arange(len(order)), 0))
    rank = np.arange(len(order)) - start
    out[rows[order]] = 1.0 / (1.0 + rank)
    return out


class LogReg(NamedTuple):
    """A fitted logistic regression on standardised features (float64)."""

    mean: torch.Tensor  # (8,)
    std: torch.Tensor  # (8,)
    weight: torch.Tensor  # (8,)
    bias: torch.Tensor  # ()

    def scores(self, table: FeatureTable) -> np.ndarray:
        """P(positive) of every row of `table` (any table with the same feature columns)."""
        with torch.no_grad():
            z = (torch.from_numpy(table.features.astype(np.float64)) - self.mean) / self.std
            return torch.sigmoid(z @ self.weight + self.bias).numpy()


def fit_logreg(table: FeatureTable, train_rows: np.ndarray, max_iter: int = 200) -> LogReg:
    """Logistic regression on the last step's features, fitted on `train_rows` only."""
    x_train = torch.from_numpy(table.features[train_rows].astype(np.float64))
    mean = x_train.mean(dim=0)
    std = x_train.std(dim=0).clamp_min(1e-6)
    y_train = torch.from_numpy(table.label[train_rows].astype(np.float64))
    num_pos = float(y_train.sum())
    pos_weight = torch.tensor((len(y_train) - num_pos) / max(num_pos, 1.0), dtype=torch.float64)
    z_train = (x_train - mean) / std
    weight = torch.zeros(x_train.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            z_train @ weight + bias, y_train, pos_weight=pos_weight
        )
        # A small L2 term keeps the fit finite when a feature separates the train rows.
        loss = loss + 1e-4 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return LogReg(mean, std, weight.detach(), bias.detach())


def oracle_scores(table: FeatureTable) -> np.ndarray:
    return table.label.astype(np.float64)


def baseline_scorers(
    fit_table: FeatureTable, train_rows: np.ndarray
) -> dict[str, Callable[[FeatureTable], np.ndarray]]:
    """Each baseline as a function from a table to one score per row; the fitted ones are
    fitted on `train_rows` of `fit_table` (and may then score another trace's table)."""
    logreg = fit_logreg(fit_table, train_rows)
    return {"rule": rule_scores, "logreg": logreg.scores, "oracle": oracle_scores}
