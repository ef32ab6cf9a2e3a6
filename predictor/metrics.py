"""The predictor's metric functions in plain numpy (AUROC, AUPRC, precision/recall/F1 at
a threshold, event recall), defined in predictor.evaluate's docstring.

Below both `predictor.model` (its validation step logs AUROC and AUPRC) and
`predictor.evaluate` (which scores checkpoints and baselines with them). Imports numpy
only.
"""

from __future__ import annotations

import math

import numpy as np


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    labels = labels.astype(bool)
    num_pos = int(labels.sum())
    num_neg = len(labels) - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    # Average ranks over ties (Mann-Whitney U).
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts  # 0-based rank of each distinct value's first member
    mean_rank = first_rank + (counts - 1) / 2.0 + 1.0
    ranks = mean_rank[inverse.reshape(-1)]
    u = ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0
    return float(u / (num_pos * num_neg))


def _curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, tp, fp) at each distinct score, descending: predict positive when
    score >= threshold."""
    order = np.argsort(-scores, kind="stable")
    sorted_scores = scores[order]
    sorted_labels = labels[order].astype(np.int64)
    last_of_value = np.flatnonzero(np.r_[sorted_scores[1:] != sorted_scores[:-1], True])
    tp = np.cumsum(sorted_labels)[last_of_value]
    fp = (last_of_value + 1) - tp
    return sorted_scores[last_of_value], tp, fp


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    num_pos = int(labels.sum())
    if num_pos == 0:
        return math.nan
    _, tp, fp = _curve(scores, labels)
    precision = tp / (tp + fp)
    recall = tp / num_pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def best_f1_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The threshold that maximises F1 on these rows (the operating point, chosen on val)."""
    num_pos = int(labels.sum())
    if num_pos == 0 or len(scores) == 0:
        return math.inf  # nothing to find: predict nothing
    thresholds, tp, fp = _curve(scores, labels)
    f1 = 2 * tp / (tp + fp + num_pos)
    return float(thresholds[int(np.argmax(f1))])


def binary_metrics(
    scores: np.ndarray,
    labels: np.ndarray,
    time_to_preemption_s: np.ndarray,
    threshold: float,
    event_key: np.ndarray | None = None,
) -> dict[str, float]:
    """Every metric of the module docstring, as plain numbers (NaN when undefined).
    `event_key` (N, 2): (request group, event time in us) of each row, for event_recall."""
    labels = labels.astype(bool)
    predicted = scores >= threshold
    tp = int(np.sum(predicted & labels))
    fp = int(np.sum(predicted & ~labels))
    fn = int(np.sum(~predicted & labels))
    lead = time_to_preemption_s[predicted & labels]
    out: dict[str, float] = {
        "auroc": roc_auc(scores, labels),
        "auprc": average_precision(scores, labels),
        "threshold": float(threshold),
        "precision": tp / (tp + fp) if tp + fp else math.nan,
        "recall": tp / (tp + fn) if tp + fn else math.nan,
        "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan,
        "mean_lead_time_s": float(lead.mean()) if len(lead) else math.nan,
        "num_rows": len(labels),
        "num_positive": int(labels.sum()),
        "num_predicted": int(predicted.sum()),
    }
    if event_key is not None:
        out["event_recall"] = event_recall(predicted, labels, event_key)
        out["event_recall_ahead"] = event_recall(predicted & (time_to_preemption_s > 0), labels, event_key)
    return out


def event_recall(predicted: np.ndarray, labels: np.ndarray, event_key: np.ndarray) -> float:
    """Share of preemption events with at least one positive row predicted positive."""
    if not labels.any():
        return math.nan
    events = np.unique(event_key[labels], axis=0)
    warned = np.unique(event_key[labels & predicted], axis=0)
    return len(warned) / len(events)
