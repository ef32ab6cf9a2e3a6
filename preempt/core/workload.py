"""Request traces and the workloads built from them.

Owns: reading trace files (Azure LLM-inference CSV, Mooncake JSONL) into `TraceRow`s,
the bundled traces (`BUNDLED_TRACES`), and turning a `WorkloadConfig` plus a seed into the
list of `Request`s a run replays: slicing, rate scaling, synthetic arrivals, SLA levels,
prompt token ids and the `max_tokens` a server is told.

Must never: import torch, touch the engine or scheduler, keep module-level mutable state
(no caches: loading the largest bundled trace takes tens of milliseconds), or let a
malformed trace through silently: every problem raises `TraceError` naming the file, the
line and the problem.

Decisions worth knowing:
- Duplicate timestamps are legitimate, not malformed: concurrent arrivals happen, and the
  Mooncake trace has several requests at the same millisecond. They are kept in file
  order. Only timestamps that go *backwards* are rejected.
- Azure timestamps (`2023-11-16 18:17:03.9799600`, 100 ns resolution) are parsed into
  integer nanoseconds, and a row's `arrival_s` is the exact integer difference to the
  first row, divided once (so 0.052 s reads as 0.052, not 0.05199999...).
- A slice `[start_s, start_s + duration_s)` is re-based to the window's start, not to its
  first arrival: a quiet start of the window stays quiet. Then times are divided by
  `rate_scale`.
- Each random purpose (arrivals, SLA levels, prompts, max_tokens noise) has its own
  stream, so changing e.g. the SLA mix never changes the prompts.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from preempt.core.config import WorkloadConfig
from preempt.core.request import Request


class TraceError(ValueError):
    """A trace that cannot be found or read; the message names the file, line and problem."""


class TraceRow(NamedTuple):
    """One request of a trace."""

    arrival_s: float  # seconds after the trace's first row
    prompt_tokens: int
    output_tokens: int


_TRACE_DIR = Path(__file__).parents[1] / "traces"  # preempt/traces: package data

BUNDLED_TRACES: dict[str, str] = {
    "azure-code": "azure_code_2023.csv",
    "azure-conv": "azure_conv_2023.csv",
    "mooncake-synthetic": "mooncake_synthetic.jsonl",
}
"""Bundled trace name -> file in preempt/traces/ (see its README for sources and licenses)."""

# Azure columns: timestamp, prompt length, output length.
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Mooncake fields: timestamp (ms), prompt length, output length; `hash_ids` is ignored.
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")

_TIMESTAMP_RE = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_SECONDS_RE = re.compile(r"(\d+)(?:\.(\d*))?")
_INT_RE = re.compile(r"[+-]?\d+")
_NS_PER_S = 1_000_000_000
_NS_PER_DAY = 86_400 * _NS_PER_S

# Stream ids for np.random.SeedSequence(seed, spawn_key=(id,)): fixed per purpose so that
# adding a purpose later never reshuffles the existing ones.
_STREAM_ARRIVALS = 0
_STREAM_SLA = 1
_STREAM_PROMPTS = 2
_STREAM_MAX_TOKENS = 3

# Prompt token ids are printable ASCII bytes: valid for the byte-level tokenizer (256) and
# far below any special token id of a real vocabulary.
_PROMPT_TOKEN_LOW = 32
_PROMPT_TOKEN_HIGH = 127  # exclusive


# ---------------------------------------------------------------- finding and loading


def resolve_trace(name_or_path: str | Path) -> Path:
    """A bundled trace name (`azure-conv`, `azure-code`, `mooncake-synthetic`) or a file path
    -> the file's path."""
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_TRACES:
        return _TRACE_DIR / BUNDLED_TRACES[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    names = ", ".join(sorted(BUNDLED_TRACES))
    raise TraceError(f"unknown trace '{name_or_path}': not a bundled trace ({names}) and not a file")


def load_trace(name_or_path: str | Path) -> list[TraceRow]:
    """Read a trace (bundled name or path) into rows sorted by arrival, the first at 0.0.

    The format is chosen by extension (`.csv`: Azure; `.jsonl`/`.json`/`.ndjson`: Mooncake),
    otherwise by content (a line starting with `{` means JSONL)."""
    path = resolve_trace(name_or_path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a BOM from Excel exports
    except UnicodeDecodeError as err:
        raise TraceError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise TraceError(f"{path}: cannot read: {err.strerror}") from None
    # split on "\n" only (and strip "\r"), so line numbers match what an editor shows.
    lines = [line.rstrip("\r") for line in text.split("\n")]
    if not any(line.strip() for line in lines):
        raise TraceError(f"{path}: empty file, no requests")
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES or (suffix != ".csv" and text.lstrip().startswith("{")):
        return _parse_mooncake(path, lines)
    return _parse_azure(path, lines)


def _checked_length(number: int, field: str, where: str) -> int:
    # a request has at least one prompt token and produces at least one output token
    if number < 1:
        raise TraceError(f"{where}: {field} must be >= 1, got {number}")
    return number


def _csv_length(text: str, field: str, where: str) -> int:
    if not _INT_RE.fullmatch(text):
        raise TraceError(f"{where}: {field} is not an integer: {text!r}")
    return _checked_length(int(text), field, where)


def _json_length(value: object, field: str, where: str) -> int:
    # JSON must hold a number: a quoted "5", 5.0 or true is a malformed trace
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceError(f"{where}: {field} is not an integer: {value!r}")
    return _checked_length(value, field, where)


def _parse_azure_timestamp(text: str, where: str, day_cache: dict[str, int]) -> int:
    """`2023-11-16 18:17:03.9799600` -> integer nanoseconds since 0001-01-01 (exact); a
    plain number of seconds (`12.5`, a trace a user wrote) -> nanoseconds since 0."""
    seconds_match = _SECONDS_RE.fullmatch(text.strip())
    if seconds_match is not None:
        whole, fraction = seconds_match.groups()
        return int(whole) * _NS_PER_S + (int(fraction[:9].ljust(9, "0")) if fraction else 0)
    match = _TIMESTAMP_RE.fullmatch(text.strip())
    if match is None:
        raise TraceError(
            f"{where}: bad TIMESTAMP {text!r} (expected a date and time like "
            "'2023-11-16 18:17:03.9799600', or seconds like '12.5')"
        )
    date_text, hours, minutes, seconds, fraction = match.groups()
    days = day_cache.get(date_text)
    if days is None:
        try:
            days = dt.date.fromisoformat(date_text).toordinal()
        except ValueError:
            raise TraceError(f"{where}: bad TIMESTAMP {text!r} (no such date)") from None
        day_cache[date_text] = days
    h, m, s = int(hours), int(minutes), int(seconds)
    if h > 23 or m > 59 or s > 59:
        raise TraceError(f"{where}: bad TIMESTAMP {text!r} (no such time of day)")
    ns = int(fraction.ljust(9, "0")) if fraction else 0
    return days * _NS_PER_DAY + ((h * 60 + m) * 60 + s) * _NS_PER_S + ns


def _split_csv_line(line: str) -> list[str]:
    # Azure traces never quote fields; plain split is ~10x faster than the csv module here.
    # Whitespace and surrounding double quotes (some exporters add them) are stripped.
    return [field.strip().strip('"') for field in line.split(",")]


def _parse_azure(path: Path, lines: list[str]) -> list[TraceRow]:
    header_index = next(i for i, line in enumerate(lines) if line.strip())
    header = _split_csv_line(lines[header_index])
    missing = [name for name in _AZURE_COLUMNS if name not in header]
    if missing:
        raise TraceError(
            f"{path}:{header_index + 1}: missing column {', '.join(repr(m) for m in missing)} "
            f"(expected header {','.join(_AZURE_COLUMNS)}, got {','.join(header)})"
        )
    i_time, i_prompt, i_output = (header.index(name) for name in _AZURE_COLUMNS)
    num_fields = len(header)
    day_cache: dict[str, int] = {}  # the whole trace is usually one or two dates
    rows: list[TraceRow] = []
    first_ns = prev_ns = 0
    for i in range(header_index + 1, len(lines)):
        line = lines[i]
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        fields = _split_csv_line(line)
        if len(fields) != num_fields:
            raise TraceError(f"{where}: expected {num_fields} fields like the header, got {len(fields)}")
        ns = _parse_azure_timestamp(fields[i_time], where, day_cache)
        in_seconds = _SECONDS_RE.fullmatch(fields[i_time]) is not None
        if not rows:
            first_ns = prev_ns = ns
            first_in_seconds = in_seconds
        elif in_seconds != first_in_seconds:
            raise TraceError(
                f"{where}: TIMESTAMP {fields[i_time]!r} is "
                + ("seconds" if in_seconds else "a date and time")
                + " but the first row's is "
                + ("seconds" if first_in_seconds else "a date and time")
                + "; use one form throughout"
            )
        elif ns < prev_ns:
            raise TraceError(
                f"{where}: TIMESTAMP goes backwards ({fields[i_time]} is {(prev_ns - ns) / _NS_PER_S:g} s "
                "before the previous row's); the trace must be sorted by time"
            )
        prompt = _csv_length(fields[i_prompt], "ContextTokens", where)
        output = _csv_length(fields[i_output], "GeneratedTokens", where)
        rows.append(TraceRow((ns - first_ns) / _NS_PER_S, prompt, output))
        prev_ns = ns
    if not rows:
        raise TraceError(f"{path}:{header_index + 1}: header only, no requests")
    return rows


def _parse_mooncake(path: Path, lines: list[str]) -> list[TraceRow]:
    rows: list[TraceRow] = []
    first_ms: int | float = 0
    prev_ms: int | float = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
        missing = [name for name in _MOONCAKE_FIELDS if name not in record]
        if missing:
            raise TraceError(f"{where}: missing field {', '.join(repr(m) for m in missing)}")
        ms = record["timestamp"]
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise TraceError(f"{where}: bad timestamp {ms!r} (expected milliseconds >= 0)")
        if not rows:
            first_ms = prev_ms = ms
        elif ms < prev_ms:
            raise TraceError(
                f"{where}: timestamp goes backwards ({ms} ms is before the previous row's {prev_ms} ms); "
                "the trace must be sorted by time"
            )
        prompt = _json_length(record["input_length"], "input_length", where)
        output = _json_length(record["output_length"], "output_length", where)
        # integer ms stay exact until this one division
        rows.append(TraceRow((ms - first_ms) / 1000, prompt, output))
        prev_ms = ms
    return rows


# ---------------------------------------------------------------- building a workload


def _stream(seed: int, stream_id: int) -> np.random.Generator:
    # SeedSequence wants entropy >= 0; the mask keeps negative seeds distinct and deterministic.
    entropy = seed & 0xFFFF_FFFF_FFFF_FFFF
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy, spawn_key=(stream_id,))))


def _synthetic_arrivals(cfg: WorkloadConfig, num: int, mean_gap_s: float, seed: int) -> np.ndarray:
    """Arrival times (num,) of a renewal process starting at 0 whose gaps have mean
    `mean_gap_s`: exponential (poisson) or gamma with the configured coefficient of variation."""
    if mean_gap_s <= 0:
        return np.zeros(num)  # every trace arrival was at one instant: keep them together
    rng = _stream(seed, _STREAM_ARRIVALS)
    if cfg.arrival == "poisson":
        gaps = rng.exponential(mean_gap_s, size=num)
    else:
        shape = 1.0 / cfg.gamma_cv**2  # cv of a gamma is 1/sqrt(shape); cv > 1 gives bursts
        gaps = rng.gamma(shape, mean_gap_s / shape, size=num)
    return np.cumsum(gaps)


def _sla_levels(mix: dict[int, float], num: int, seed: int) -> np.ndarray:
    levels = sorted(mix)  # sorted: the dict's key order must not change the draw
    shares = np.array([mix[level] for level in levels], dtype=np.float64)
    shares /= shares.sum()  # the config allows 1e-6 slack; numpy's check is tighter
    return _stream(seed, _STREAM_SLA).choice(np.array(levels, dtype=np.int64), size=num, p=shares)


def _max_tokens(cfg: WorkloadConfig, true_output: np.ndarray, seed: int) -> np.ndarray:
    if cfg.max_tokens_mode == "trace":
        return true_output.copy()
    if cfg.max_tokens_mode == "fixed":
        return np.full_like(true_output, cfg.max_tokens_fixed)
    noise = _stream(seed, _STREAM_MAX_TOKENS).lognormal(0.0, cfg.max_tokens_noise, size=true_output.shape)
    # clamp while still float: a huge sigma can overflow to inf, which has no int64 value
    return np.clip(np.rint(true_output * noise), 1, cfg.max_tokens_fixed).astype(np.int64)


def _prompts(prompt_lengths: np.ndarray, seed: int, vocab_size: int) -> list[np.ndarray]:
    """Prompt token ids, (P_i,) int32 each: one vectorised draw split into requests, so a
    19k-request hour of ~1k-token prompts takes a fraction of a second. Request i's tokens
    depend on the seed and on the prompt lengths of requests 0..i only."""
    low, high = _PROMPT_TOKEN_LOW, min(_PROMPT_TOKEN_HIGH, vocab_size)
    if high <= low:  # a vocabulary too small for printable ASCII: use all of it
        low, high = 0, vocab_size
    num_tokens = int(prompt_lengths.sum())
    tokens = _stream(seed, _STREAM_PROMPTS).integers(low, high, size=num_tokens, dtype=np.int32)  # (sum P,)
    return np.split(tokens, np.cumsum(prompt_lengths)[:-1])


def build_workload(cfg: WorkloadConfig, seed: int, vocab_size: int = 256) -> list[Request]:
    """The requests of one run, in arrival order (request_id 0..N-1).

    Slices the trace to `[start_s, start_s + duration_s)`, re-based to the window's start;
    keeps at most `num_requests`; arrivals are the trace's own times divided by
    `rate_scale`, or synthetic (poisson/gamma) at the slice's mean rate times `rate_scale`.
    Lengths always come from the trace: `target_output_tokens` is the true output length,
    `max_tokens` follows `max_tokens_mode`. Same (cfg, seed, vocab_size) -> same workload."""
    if not 0 < vocab_size <= 2**31:
        raise ValueError(f"vocab_size must be in [1, 2**31], got {vocab_size}")
    rows = load_trace(cfg.trace)
    trace_arrivals = np.fromiter((row.arrival_s for row in rows), dtype=np.float64, count=len(rows))
    trace_end_s = float(trace_arrivals[-1])
    window_end_s = math.inf if cfg.duration_s is None else cfg.start_s + cfg.duration_s
    # rows are sorted, so the window is one contiguous run
    lo = int(np.searchsorted(trace_arrivals, cfg.start_s, side="left"))
    hi = int(np.searchsorted(trace_arrivals, window_end_s, side="left"))
    num_in_window = hi - lo
    if num_in_window == 0:
        raise TraceError(
            f"trace '{cfg.trace}': no requests in the slice [{cfg.start_s:g}, {window_end_s:g}) s "
            f"(its arrivals span 0 to {trace_end_s:g} s)"
        )
    num = num_in_window if cfg.num_requests is None else min(cfg.num_requests, num_in_window)
    window = rows[lo : lo + num]
    prompt_lengths = np.fromiter((row.prompt_tokens for row in window), dtype=np.int64, count=num)
    true_output = np.fromiter((row.output_tokens for row in window), dtype=np.int64, count=num)

    if cfg.arrival == "trace":
        arrivals = (trace_arrivals[lo : lo + num] - cfg.start_s) / cfg.rate_scale
    else:
        # The slice's rate counts every request in the window (before the num_requests cap);
        # the window ends where the trace does if it reaches past it.
        window_span_s = min(window_end_s, trace_end_s) - cfg.start_s
        mean_gap_s = window_span_s / num_in_window / cfg.rate_scale
        arrivals = _synthetic_arrivals(cfg, num, mean_gap_s, seed)

    sla_levels = _sla_levels(cfg.sla_mix, num, seed)
    max_tokens = _max_tokens(cfg, true_output, seed)
    prompts = _prompts(prompt_lengths, seed, vocab_size)
    # tolist(): plain Python numbers for the Request fields, converted in one pass
    return [
        Request(
            request_id=i,
            arrival_s=arrival_s,
            prompt_token_ids=prompt,
            max_tokens=budget,
            target_output_tokens=true_len,
            sla_level=level,
        )
        for i, (arrival_s, prompt, budget, true_len, level) in enumerate(
            zip(
                arrivals.tolist(),
                prompts,
                max_tokens.tolist(),
                true_output.tolist(),
                sla_levels.tolist(),
                strict=True,
            )
        )
    ]


def trace_window(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The trace window a run (its summary.json) or a dataset (its collect meta) replayed,
    from the config it records: {"trace", "start_s", "end_s"} in the trace's own seconds
    (before rate scaling; `end_s` None: to the end). None without a config (unknown)."""
    workload = (meta.get("config") or {}).get("workload")
    if not workload:
        return None
    start = float(workload.get("start_s", 0.0))
    duration = workload.get("duration_s")
    return {
        "trace": str(workload.get("trace", meta.get("trace"))),
        "start_s": start,
        "end_s": None if duration is None else start + float(duration),
    }
