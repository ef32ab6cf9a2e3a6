"""Metrics of a preemption predictor, and the evaluation of a checkpoint against baselines.

Owns: the metrics of a scored split (defined below; the plain-numpy functions live in
predictor.metrics, which the model's validation step uses too), the choice of the
operating threshold on val (max F1, or by the stall avoided and bytes wasted of early saves:
`expected_value_curve`), and `evaluate_checkpoint`, behind `preempt
eval-predictor` (and `python -m predictor.evaluate`, which adds the distribution-shift
options). Every predictor is
scored the same way: threshold chosen on val, metrics reported on the chosen split;
`render_evaluation` is the short table `preempt eval-predictor` prints (`--json`: the
whole report). In a
distribution-shift test (`source`), val and the fitted baselines come from the training
data, and the other dataset is only scored, as a deployed predictor would meet it.
The LSTM's scores are its outputs over whole request histories, i.e. exactly what the
online predictor returns (preempt.early.online_predictor).

Must never: choose a threshold on the rows it reports (that would flatter every
predictor alike, and hide how far the val choice transfers), or reach the network.

Definitions (scores: higher = more likely preempted within the horizon):
- auroc: P(score of a random positive > score of a random negative), ties count half.
- auprc: average precision, sum over thresholds of (recall step) * precision, as
  scikit-learn's `average_precision_score` (ties broken by grouping equal scores).
- precision / recall / f1 at `threshold` (predict positive when score >= threshold).
- mean_lead_time_s: over true positives, the mean time from the row to the preemption:
  how long an early save triggered by the prediction would have had.
- event_recall: preemption events (request, time) for which at least one row within the
  horizon before them was predicted positive: the share of preemptions an online
  predictor would have warned about.
- event_recall_ahead: the same, counting only warnings at least one logged step before
  the preempting schedule() (time to preemption > 0). The row right before a preemption
  has time 0 to it: the decision follows at once, so a warning there gives an early
  save no compute to overlap with.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from predictor.metrics import best_f1_threshold, binary_metrics

if TYPE_CHECKING:
    from predictor.data import FeatureTable
    from predictor.model import PreemptionLSTM


def event_keys(table: FeatureTable) -> np.ndarray:
    """(N, 2) int64: (request group, time of its next preemption in us); rows of one event
    agree up to float rounding of t + time_to, which the us rounding absorbs."""
    event_time = table.t_s + table.time_to_preemption_s
    event_us = np.where(np.isfinite(event_time), np.round(event_time * 1e6), -1).astype(np.int64)
    return np.stack([table.group, event_us], axis=1)


WASTE_WEIGHT = 1.0
"""Expected value (`expected_value` rule): a second of copy-link time spent on bytes that
are never claimed costs as much as a second of stall avoided. That overcharges waste on
this engine: early copies run on a lane that demand saves overtake (preempt.kv.timing), so
a wasted copy never delays a preemption's own copy-out, only later early copies (what
`preempt bench early` reports as the `queued` part of the save stall; docs/archive/predictor-history.md).
Hence the default rule, `waste_capped`."""

MAX_WASTE_SHARE = 0.30
"""`waste_capped`: the largest share of early-copied bytes that may be wasted on val (the
target for the share wasted live)."""

WASTE_BOUND_Z = 1.96
"""`waste_capped`: the walk down the curve ends at the first threshold whose waste share is
over the cap beyond doubt: the lower end of its 95% Wilson interval, taking the request
epochs it warned as the samples, is above the cap. A share measured on a few dozen epochs
is noisy (+-0.15 at 30), and ending the walk at the first estimate over the cap made the
rule choose never to warn on the default collect (the first point warning 30 epochs
wasted 0.308 of its bytes against a 0.30 cap; docs/archive/predictor-history.md)."""


def wilson_lower(share: float, n: float, z: float = WASTE_BOUND_Z) -> float:
    """The lower end of the Wilson score interval of a proportion `share` seen in `n`
    samples (0 when n is 0)."""
    if n <= 0:
        return 0.0
    denominator = 1.0 + z * z / n
    centre = share + z * z / (2 * n)
    spread = z * math.sqrt(share * (1.0 - share) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / denominator)


def expected_value_curve(
    table: FeatureTable,
    rows: np.ndarray,
    scores: np.ndarray,
    waste_weight: float = WASTE_WEIGHT,
    num_points: int = 160,
) -> list[dict[str, float]]:
    """The precision/recall curve with the expected value of each threshold, as the
    engine's early saves would realise it (preempt.kv.saver): a warned row copies the
    request's full blocks not yet copied since its last preemption; those bytes are
    claimed at its next preemption, where they avoid their copy time at the measured
    copy rate (at most the lead time of the first warning: a copy must end in time), or
    wasted if it finishes first. EV = stall avoided (s) - waste_weight * copy time of the
    wasted bytes (s). Needs the dataset's `num_tokens` column (collects log it)."""
    if table.num_tokens is None:
        raise ValueError("the dataset has no num_tokens column (collect it again) for the expected value")
    labels = table.label[rows].astype(bool)
    time_to = table.time_to_preemption_s[rows]
    t_s = table.t_s[rows]
    event_t = np.where(np.isfinite(time_to), t_s + time_to, np.inf)
    block = table.block_size[rows]
    full_bytes = (table.num_tokens[rows] // block * block) * table.kv_bytes_per_token[rows]
    rate = table.copy_bytes_per_s[rows]
    group = table.group[rows]
    # Epochs: a request's rows up to its next preemption (or its end); early copies
    # accumulate within one and are claimed (or wasted) at its end.
    order = np.lexsort((t_s, event_t, group))
    g, e = group[order], event_t[order]
    starts = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (e[1:] != e[:-1])])
    has_event = np.isfinite(e[starts])
    epoch_rate = rate[order][starts]
    num_pos = int(labels.sum())
    # Positives are ~1% of rows: quantiles dense towards the top, where thresholds live.
    # 160 points: with 40, neighbours near a 30% waste cap lay ~7 points of waste share
    # apart (runs/pred15b/lstm-deploy: 23.9% and 30.5%), so `waste_capped` stopped well
    # short of its cap (docs/archive/predictor-history.md).
    quantiles = np.r_[np.linspace(0.0, 0.9, 10), 1.0 - np.geomspace(0.1, 1e-5, max(2, num_points - 10)), 1.0]
    candidates = np.unique(np.quantile(scores, quantiles)) if len(scores) else []
    curve = []
    for threshold in candidates:
        warned = scores[order] >= threshold
        copied = np.maximum.reduceat(np.where(warned, full_bytes[order], 0.0), starts)
        lead = np.maximum.reduceat(np.where(warned, time_to[order], -1.0), starts)
        with np.errstate(invalid="ignore", divide="ignore"):
            copy_s = np.where(epoch_rate > 0, copied / epoch_rate, 0.0)
        avoided = np.minimum(copy_s, np.maximum(lead, 0.0))[has_event].sum()
        wasted_s = copy_s[~has_event].sum()
        predicted = scores >= threshold
        tp = int(np.sum(predicted & labels))
        curve.append(
            {
                "threshold": float(threshold),
                "precision": tp / int(predicted.sum()) if predicted.any() else math.nan,
                "recall": tp / num_pos if num_pos else math.nan,
                "stall_avoided_s": float(avoided),
                "wasted_copy_s": float(wasted_s),
                "wasted_gb": float(copied[~has_event].sum() / 1e9),
                "copied_gb": float(copied.sum() / 1e9),
                "waste_share": float(copied[~has_event].sum() / copied.sum()) if copied.sum() > 0 else 0.0,
                # epochs whose warnings copied something (a warning before the first
                # full block copies nothing, as online)
                "warned_epochs": int(np.count_nonzero(copied)),
                "expected_value_s": float(avoided - waste_weight * wasted_s),
            }
        )
    return curve


def best_expected_value_threshold(curve: list[dict[str, float]]) -> float:
    """The curve's threshold of the largest expected value (inf: never warn, if none pays)."""
    if not curve:
        return math.inf
    best = max(curve, key=lambda point: point["expected_value_s"])
    return best["threshold"] if best["expected_value_s"] > 0 else math.inf


def best_waste_capped_threshold(
    curve: list[dict[str, float]], max_waste_share: float = MAX_WASTE_SHARE
) -> float:
    """The threshold that avoids the most stall on val among those whose share of early
    bytes wasted is at most `max_waste_share` there. The walk goes down from the strictest
    threshold and ends at the first one over the cap beyond doubt (`WASTE_BOUND_Z`): below
    it more warnings only add waste, and a later dip under the cap is not trusted. Ties go
    to the stricter threshold. Waste is a constraint, not a stall (see WASTE_WEIGHT). inf
    (never warn) if no allowed threshold avoids any stall."""
    best: dict[str, float] | None = None
    for point in sorted(curve, key=lambda p: p["threshold"], reverse=True):
        share = point["waste_share"]
        # curves written before the epoch count: the estimate is taken as exact
        if wilson_lower(share, point.get("warned_epochs", math.inf)) > max_waste_share:
            break
        if share <= max_waste_share and (best is None or point["stall_avoided_s"] > best["stall_avoided_s"]):
            best = point
    return best["threshold"] if best is not None and best["stall_avoided_s"] > 0 else math.inf


THRESHOLD_RULES = ("waste_capped", "expected_value", "f1")


def evaluate_scores(
    table: FeatureTable,
    val_rows: np.ndarray,
    eval_rows: np.ndarray,
    val_scores: np.ndarray,
    eval_scores: np.ndarray,
    rule: str = "f1",
    max_waste_share: float = MAX_WASTE_SHARE,
) -> dict[str, Any]:
    """Threshold on val (max F1; `rule="expected_value"`: max expected value;
    `rule="waste_capped"`: most stall avoided with at most `max_waste_share` of the early
    bytes wasted; the val curve of the last two under `threshold_curve`), then every
    metric on the eval rows."""
    curve = None
    if rule in ("expected_value", "waste_capped"):
        curve = expected_value_curve(table, val_rows, val_scores)
        if rule == "expected_value":
            threshold = best_expected_value_threshold(curve)
        else:
            threshold = best_waste_capped_threshold(curve, max_waste_share)
    elif rule == "f1":
        threshold = best_f1_threshold(val_scores, table.label[val_rows])
    else:
        raise ValueError(f"threshold rule must be one of {THRESHOLD_RULES}, got '{rule}'")
    out: dict[str, Any] = binary_metrics(
        eval_scores,
        table.label[eval_rows],
        table.time_to_preemption_s[eval_rows],
        threshold,
        event_keys(table)[eval_rows],
    )
    out["threshold_rule"] = rule
    if rule == "waste_capped":
        out["max_waste_share"] = max_waste_share
    if curve is not None:
        out["threshold_curve"] = curve
    return out


def jsonable(value: Any) -> Any:
    """NaN and inf have no JSON spelling: write them as null."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def source_names(traces: list[str | None]) -> list[str]:
    """Keys of a mix's `per_source` metrics: the trace of each dataset, numbered where
    several datasets replay one trace (else their metrics would share one key)."""
    counts = {name: traces.count(name) for name in traces}
    seen: dict[str | None, int] = {}
    names = []
    for name in traces:
        seen[name] = seen.get(name, 0) + 1
        names.append(f"{name}#{seen[name]}" if counts[name] > 1 else str(name))
    return names


def load_predictor(ckpt: str | Path) -> PreemptionLSTM:
    """The trained model of a `preempt train` checkpoint, in eval mode, on the CPU."""
    from predictor.model import PreemptionLSTM

    model = PreemptionLSTM.load_from_checkpoint(str(ckpt), map_location="cpu", weights_only=True)
    return model.eval()


def evaluate_checkpoint(
    ckpt: str | Path, data: str | Path, split: str = "test", source: str | Path | None = None
) -> dict[str, Any]:
    """The LSTM of `ckpt` and every baseline on `split` of `data`.

    Without `source`: `data` is the dataset the checkpoint was trained on, split as in
    training (the checkpoint holds the split's seed and fractions); thresholds are chosen
    on its val split and logreg is fitted on its train split.

    With `source` (the dataset the checkpoint was trained on): a distribution-shift test,
    as a deployment would see it. Thresholds are chosen on the source's val split and
    logreg is fitted on the source's train split; `data` (another trace, or another slice
    of the same one) is only scored: `split="all"` scores every row of it, a named split
    scores that split of it (split with the checkpoint's seed)."""
    from predictor.baselines import baseline_scorers
    from predictor.data import (
        SPLITS,
        DataError,
        PreemptionDataModule,
        SequenceBatches,
        SplitConfig,
        load_table,
        sequence_loader,
        split_rows,
    )

    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {(*SPLITS, 'all')}, got '{split}'")
    if split == "all" and source is None:
        raise ValueError(
            "split 'all' needs a source dataset: all rows of the training data include train rows"
        )
    model = load_predictor(ckpt)
    hp = model.hparams
    split_config = SplitConfig(hp.split_seed, hp.val_fraction, hp.test_fraction)
    fit = PreemptionDataModule(source if source is not None else data, split=split_config)
    fit.setup()
    if source is None:
        table, eval_rows = fit.table, fit.rows[split]
    else:
        table = load_table(data)
        names = table.meta.get("feature_names")
        if names and list(names) != list(hp.feature_names):
            raise DataError(
                f"{data} has features {names}, the checkpoint was trained on {list(hp.feature_names)}"
            )
        horizon_ms = table.meta.get("horizon_ms")
        if horizon_ms is not None and float(horizon_ms) != float(hp.horizon_ms):
            raise DataError(
                f"{data} is labelled with a {horizon_ms} ms horizon, the checkpoint {hp.horizon_ms} ms"
            )
        eval_rows = (
            np.arange(len(table.label)) if split == "all" else split_rows(table.group, split_config)[split]
        )
    val_rows = fit.rows["val"]
    val_labels = fit.table.label[val_rows]
    keys = event_keys(table)[eval_rows]

    sources = table.source[eval_rows] if table.source is not None else np.zeros(len(eval_rows), np.int64)
    names = source_names(table.meta.get("sources") or [table.meta.get("trace")])

    def score(val_scores: np.ndarray, eval_scores: np.ndarray) -> dict[str, Any]:
        threshold = best_f1_threshold(val_scores, val_labels)
        labels, time_to = table.label[eval_rows], table.time_to_preemption_s[eval_rows]
        out: dict[str, Any] = binary_metrics(eval_scores, labels, time_to, threshold, keys)
        if len(names) > 1:  # a mix: the same rows and threshold, reported per trace
            out["per_source"] = {
                str(name): binary_metrics(
                    eval_scores[sources == i],
                    labels[sources == i],
                    time_to[sources == i],
                    threshold,
                    keys[sources == i],
                )
                for i, name in enumerate(names)
            }
        return out

    eval_loader = sequence_loader(SequenceBatches(table, eval_rows), fit.batch_size)
    lstm_scores = model.predict_rows(eval_loader, eval_rows)
    results: dict[str, Any] = {"lstm": score(model.predict_rows(fit.loader("val"), val_rows), lstm_scores)}
    operating = hp.get("threshold")
    # what the engine's `lstm` policy does: the same scores at the checkpoint's threshold
    at_checkpoint = None
    if operating is not None:
        labels, time_to = table.label[eval_rows], table.time_to_preemption_s[eval_rows]
        at_checkpoint = binary_metrics(lstm_scores, labels, time_to, float(operating), keys)
    for name, scorer in baseline_scorers(fit.table, fit.rows["train"]).items():
        results[name] = score(scorer(fit.table)[val_rows], scorer(table)[eval_rows])
    return {
        "data": str(data),
        "source": None if source is None else str(source),
        "ckpt": str(ckpt),
        "split": split,
        "num_rows": len(eval_rows),
        "positive_rate": float(table.label[eval_rows].mean()) if len(eval_rows) else math.nan,
        "horizon_ms": table.meta.get("horizon_ms"),
        # Two thresholds, named so that neither is mistaken for the other: each scorer's
        # row below is at its own best-F1 threshold on val (to compare scorers alike); the
        # engine's `lstm` policy uses the checkpoint's operating threshold (`preempt train`).
        "threshold_rule": "f1: each scorer at its best-F1 threshold on val",
        "checkpoint_threshold": operating,
        "checkpoint_threshold_rule": hp.get("threshold_rule"),
        "checkpoint_metrics": at_checkpoint,
        "predictors": results,
    }


EVALUATION_COLUMNS = (
    ("AUPRC", "auprc", "{:.3f}"),
    ("threshold", "threshold", "{:.3g}"),
    ("precision", "precision", "{:.3f}"),
    ("recall", "recall", "{:.3f}"),
    ("F1", "f1", "{:.3f}"),
    ("steps warned", "num_predicted", "{:,}"),
    ("preemptions warned", "event_recall", "{:.0%}"),
    ("warned ahead", "event_recall_ahead", "{:.0%}"),
    ("lead ms", "mean_lead_time_s", "{:.1f}"),
)
"""`render_evaluation`'s columns: (heading, metric, format); `lead ms` is in milliseconds."""


def _evaluation_row(name: str, metrics: dict[str, Any]) -> str:
    cells = [name]
    for _, key, form in EVALUATION_COLUMNS:
        value = metrics.get(key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            cells.append("–")
        else:
            cells.append(form.format(value * 1000 if key == "mean_lead_time_s" else value))
    return "| " + " | ".join(cells) + " |"


def render_evaluation(report: dict[str, Any]) -> str:
    """`evaluate_checkpoint`'s report as a short markdown table: one row per scorer (per
    trace too, for a mix) and the LSTM at the checkpoint's own threshold, headed by what
    was scored."""
    rate, num_rows = report.get("positive_rate"), report["num_rows"]
    positives = f"{round(rate * num_rows):,}" if rate is not None and math.isfinite(rate) else "?"
    source = f"; thresholds and logreg from {report['source']}" if report.get("source") else ""
    horizon = f"{report['horizon_ms']:g}" if report.get("horizon_ms") is not None else "?"
    lines = [
        f"{report['data']}, {report['split']} rows{source}: {num_rows:,} logged steps, {positives} of "
        f"them preempted within {horizon} ms.",
        "Each scorer at its own best-F1 threshold on val; preemptions warned: with a warning in the "
        "horizon before them (ahead: a logged step or more before).",
        "",
        "| scorer | " + " | ".join(heading for heading, _, _ in EVALUATION_COLUMNS) + " |",
        "| --- |" + " ---: |" * len(EVALUATION_COLUMNS),
    ]
    for name, metrics in report["predictors"].items():
        lines.append(_evaluation_row(name, metrics))
        lines += [_evaluation_row(f"{name}, {s}", m) for s, m in (metrics.get("per_source") or {}).items()]
    if report.get("checkpoint_metrics") is not None:
        name = f"lstm at its checkpoint's threshold ({report.get('checkpoint_threshold_rule') or '?'})"
        lines.append(_evaluation_row(name, report["checkpoint_metrics"]))
    else:
        lines += ["", "The checkpoint holds no operating threshold (older than `preempt train` storing one)."]
    return "\n".join(lines)
