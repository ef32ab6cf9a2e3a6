"""Published end-to-end latencies, held out from the clock's fit (issue #13).

Owns: the bundled table (`preempt/calibrate/data/published_e2e.csv`, sources in the README
next to it), its validation, and the step shapes a published measurement implies, priced by
`CostModel`. Nothing here is fitted: these points check the fitted clock from outside.

A measurement is one of four metrics, each turned into the seconds it spans:
    latency               one static batch end to end: prefill + (output_len - 1) decodes
    first_token_latency   the prefill step alone (output_len 1)
    tokens_per_s_per_seq  output_len / (the batch's end-to-end seconds)      (batch 1)
    output_tokens_per_s   batch * output_len / (the batch's end-to-end seconds)
The shapes follow the engine's (`preempt.engine.engine._step_shape`): the prefill is one
chunk of every prompt, each token at position p attending to p + 1 keys; decode step k
(1..output_len-1) gives each of the batch's sequences one token at context input_len + k.
Masked pairs are not reported (0), as the engine does not report them.
"""

from __future__ import annotations

import csv
import math
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from preempt.core.cost_model import CostModel, StepShape
from preempt.core.profiles import MODELS, TargetProfile, bundled_devices, load_device

DATA_FILE = "published_e2e.csv"
# metric -> the units a source may give it in (value x factor = the metric's base unit)
METRICS: dict[str, dict[str, float]] = {
    "latency": {"ms": 1e-3, "s": 1.0},
    "first_token_latency": {"ms": 1e-3, "s": 1.0},
    "tokens_per_s_per_seq": {"tok/s": 1.0},
    "output_tokens_per_s": {"tok/s": 1.0},
}
COLUMNS = (
    "id",
    "source",
    "url",
    "quote",
    "gpu",
    "device",
    "model",
    "precision",
    "tp",
    "batch",
    "input_len",
    "output_len",
    "engine",
    "engine_version",
    "metric",
    "value",
    "unit",
    "measures",
)
# The clock prices 2-byte weights and KV only (ModelShape.dtype_bytes): FP8 rows are refused
PRECISIONS = ("bf16", "fp16")


class PublishedError(ValueError):
    """A malformed row of the published table; the message names the row and field."""


class PublishedPoint(NamedTuple):
    id: str
    source: str
    url: str
    quote: str
    gpu: str  # as the source describes it
    device: str  # the bundled device profile that stands for it
    model: str  # key of preempt.core.profiles.MODELS
    precision: str
    tp: int
    batch: int
    input_len: int
    output_len: int
    engine: str
    engine_version: str
    metric: str
    value: float  # as published, in `unit`
    unit: str
    measures: str  # what the published number spans, in words

    @property
    def measured_s(self) -> float:
        """The seconds the measurement spans (a batch end to end, or the prefill alone)."""
        v = self.value * METRICS[self.metric][self.unit]
        if self.metric == "tokens_per_s_per_seq":
            return self.output_len / v
        if self.metric == "output_tokens_per_s":
            return self.batch * self.output_len / v
        return v


def default_path() -> Path:
    return Path(str(resources.files("preempt").joinpath("calibrate", "data", DATA_FILE)))


def load_published(path: str | Path | None = None) -> list[PublishedPoint]:
    """The table's rows, validated; `#` lines before the header are its attribution."""
    path = Path(path) if path is not None else default_path()
    try:
        text = path.read_text()
    except OSError as err:
        raise PublishedError(f"cannot read {path}: {err.strerror}") from None
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise PublishedError(f"{path.name}: missing column(s) {missing}")
    points, seen = [], set()
    for n, row in enumerate(reader, start=1):
        point = parse_row(row, f"{path.name} row {n}")
        if point.id in seen:
            raise PublishedError(f"{path.name} row {n}: id: duplicate '{point.id}'")
        seen.add(point.id)
        points.append(point)
    return points


def parse_row(row: dict[str, str | None], where: str = "row") -> PublishedPoint:
    """One validated point; a bad field raises PublishedError naming it."""
    values: dict[str, object] = {}
    row_id = (row.get("id") or "").strip()
    where = f"{where} ({row_id})" if row_id else where
    for col in COLUMNS:
        raw = row.get(col)
        if raw is None or not raw.strip():
            raise PublishedError(f"{where}: {col}: empty (every field is required)")
        values[col] = raw.strip()
    for col in ("tp", "batch", "input_len", "output_len"):
        values[col] = _positive_int(str(values[col]), f"{where}: {col}")
    try:
        value = float(str(values["value"]))
    except ValueError:
        raise PublishedError(f"{where}: value: not a number: {values['value']!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise PublishedError(f"{where}: value: must be > 0, got {values['value']!r}")
    values["value"] = value
    if values["model"] not in MODELS:
        raise PublishedError(f"{where}: model: unknown '{values['model']}'; choose one of {sorted(MODELS)}")
    if values["device"] not in bundled_devices():
        raise PublishedError(f"{where}: device: unknown '{values['device']}'; bundled: {bundled_devices()}")
    if not str(values["precision"]).startswith(PRECISIONS):
        raise PublishedError(
            f"{where}: precision: the clock prices {PRECISIONS} only, got {values['precision']!r}"
        )
    metric = values["metric"]
    if metric not in METRICS:
        raise PublishedError(f"{where}: metric: unknown '{metric}'; choose one of {sorted(METRICS)}")
    units = sorted(METRICS[str(metric)])
    if values["unit"] not in units:
        raise PublishedError(
            f"{where}: unit: '{values['unit']}' does not fit {metric}; expected one of {units}"
        )
    if metric == "first_token_latency" and values["output_len"] != 1:
        raise PublishedError(f"{where}: output_len: a first-token latency has output_len 1")
    if metric == "tokens_per_s_per_seq" and values["batch"] != 1:
        raise PublishedError(f"{where}: batch: tokens/s per sequence is read at batch 1 only")
    tp = values["tp"]
    if tp != 1 and tp not in load_device(str(values["device"])).all_reduce:
        raise PublishedError(f"{where}: tp: device '{values['device']}' has no all-reduce for {tp} GPUs")
    return PublishedPoint(**values)  # type: ignore[arg-type]


def _positive_int(raw: str, key: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise PublishedError(f"{key}: not an integer: {raw!r}") from None
    if n < 1:
        raise PublishedError(f"{key}: must be >= 1, got {raw!r}")
    return n


# ------------------------------------------------------------------------ shapes
def prefill_shape(batch: int, input_len: int) -> StepShape:
    """Every prompt in one chunk: token p attends to p + 1 keys."""
    return StepShape(
        num_tokens=batch * input_len,
        sum_attn_ctx=batch * input_len * (input_len + 1) // 2,
        sum_kv_read=batch * input_len,
        num_seqs=batch,
        sum_masked_ctx=batch * input_len * (input_len - 1) // 2,
    )


def decode_shape(batch: int, context: int) -> StepShape:
    """One new token per sequence, each attending to `context` keys (itself included)."""
    return StepShape(
        num_tokens=batch, sum_attn_ctx=batch * context, sum_kv_read=batch * context, num_seqs=batch
    )


def steps(point: PublishedPoint) -> list[StepShape]:
    """The engine steps the measurement spans: the prefill, then output_len - 1 decodes
    (the prefill samples the first output token; none for a first-token latency)."""
    shapes = [prefill_shape(point.batch, point.input_len)]
    if point.metric != "first_token_latency":
        shapes += [decode_shape(point.batch, point.input_len + k) for k in range(1, point.output_len)]
    return shapes


class Prediction(NamedTuple):
    predicted_s: float  # the clock as the engine runs it, host overhead per step included
    gpu_s: float  # the same steps less the clock's fixed host overhead per step
    all_reduce_s: float  # the tensor-parallel all-reduces' share of predicted_s
    num_steps: int


def cost_model(point: PublishedPoint) -> CostModel:
    model = MODELS[point.model]
    device = load_device(point.device)
    return CostModel(TargetProfile(f"{point.tp}x{device.name}-{model.name}", model, point.tp, device))


def predict(point: PublishedPoint, cost: CostModel | None = None) -> Prediction:
    cost = cost or cost_model(point)
    shapes = steps(point)
    times = [cost.op_times(s) for s in shapes]
    total = sum(t.total for t in times)
    cpu = sum(t.cpu for t in times)
    return Prediction(total, total - cpu, sum(t.all_reduce for t in times), len(shapes))
