"""Tests for preempt.core.workload: trace loaders, malformed input, and workload building."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preempt.core.config import WorkloadConfig
from preempt.core.workload import (
    BUNDLED_TRACES,
    TraceError,
    TraceRow,
    build_workload,
    load_trace,
    resolve_trace,
)

# ---------------------------------------------------------------- bundled traces


@pytest.mark.parametrize(
    ("name", "num_rows", "first_rows", "span_s"),
    [
        ("azure-code", 8819, [TraceRow(0.0, 4808, 10), TraceRow(0.052, 3180, 8)], 3435.948056),
        ("azure-conv", 19366, [TraceRow(0.0, 374, 44), TraceRow(4.314579, 396, 109)], 3501.721937),
        ("mooncake-synthetic", 3993, [TraceRow(0.0, 40160, 6), TraceRow(0.0, 36640, 4)], 1022.025),
    ],
)
def test_bundled_trace_loads(name: str, num_rows: int, first_rows: list[TraceRow], span_s: float) -> None:
    rows = load_trace(name)
    assert len(rows) == num_rows
    # exact equality: timestamps are parsed as integers, so 0.052 s is 0.052, not 0.0519999
    assert rows[: len(first_rows)] == first_rows
    assert rows[-1].arrival_s == pytest.approx(span_s, abs=1e-9)
    arrivals = np.array([row.arrival_s for row in rows])
    assert np.all(np.diff(arrivals) >= 0)
    assert min(min(row.prompt_tokens, row.output_tokens) for row in rows) >= 1


def test_bundled_files_ship_with_the_package() -> None:
    for name, file_name in BUNDLED_TRACES.items():
        path = resolve_trace(name)
        assert path.name == file_name and path.is_file()
    assert (resolve_trace("azure-conv").parent / "README.md").is_file()


def test_resolve_trace_accepts_a_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,6\n")
    assert resolve_trace(path) == path
    assert resolve_trace(str(path)) == path
    assert load_trace(path) == [TraceRow(0.0, 5, 6)]


def test_an_azure_csv_may_give_seconds(tmp_path: Path) -> None:
    """A trace a user writes by hand: TIMESTAMP as seconds (any origin: rebased to 0)."""
    path = tmp_path / "mine.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,5,6\n1.25,7,8\n3,9,10\n")
    assert load_trace(path) == [TraceRow(0.0, 5, 6), TraceRow(1.25, 7, 8), TraceRow(3.0, 9, 10)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1700158623.5,5,6\n1700158624,7,8\n")
    assert load_trace(path) == [TraceRow(0.0, 5, 6), TraceRow(0.5, 7, 8)]


def test_unknown_trace_lists_the_bundled_names() -> None:
    with pytest.raises(
        TraceError, match=r"unknown trace 'azure-chat'.*azure-code, azure-conv, mooncake-synthetic"
    ):
        resolve_trace("azure-chat")
    with pytest.raises(TraceError, match="not a bundled trace"):
        load_trace("/no/such/trace.csv")


# ---------------------------------------------------------------- formats and edge cases

_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_azure_timestamps_are_exact_to_100ns(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        f"{_HEADER}\r\n2023-11-16 23:59:59.9999999,1,1\r\n2023-11-17 00:00:00.0000000,2,2\r\n"
        "2023-11-17 00:00:00.0000001,3,3",
    )
    assert [row.arrival_s for row in load_trace(path)] == [0.0, 1e-7, 2e-7]


def test_azure_accepts_lf_trailing_newline_extra_columns_and_no_fraction(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        "GeneratedTokens,TIMESTAMP,Extra,ContextTokens\n\n"
        "7,2023-11-16 18:00:00,x,3\n8,2023-11-16 18:00:01.5,y,4\n\n",
    )
    assert load_trace(path) == [TraceRow(0.0, 3, 7), TraceRow(1.5, 4, 8)]


def test_format_is_sniffed_when_the_extension_is_unknown(tmp_path: Path) -> None:
    jsonl = _write(tmp_path, "trace.txt", '{"timestamp": 0, "input_length": 2, "output_length": 3}\n')
    csv = _write(tmp_path, "trace.log", f"{_HEADER}\n2023-11-16 18:00:00.0,2,3\n")
    assert load_trace(jsonl) == load_trace(csv) == [TraceRow(0.0, 2, 3)]


def test_duplicate_timestamps_are_kept_in_file_order(tmp_path: Path) -> None:
    csv = _write(
        tmp_path,
        "dup.csv",
        f"{_HEADER}\r\n2023-11-16 18:00:00.5,1,1\r\n2023-11-16 18:00:00.5,2,2\r\n2023-11-16 18:00:00.5,3,3",
    )
    assert load_trace(csv) == [TraceRow(0.0, 1, 1), TraceRow(0.0, 2, 2), TraceRow(0.0, 3, 3)]
    jsonl = _write(
        tmp_path,
        "dup.jsonl",
        '{"timestamp": 7, "input_length": 9, "output_length": 1, "hash_ids": [0, 1]}\n'
        '{"timestamp": 7, "input_length": 8, "output_length": 2}\n'
        '{"timestamp": 9.5, "input_length": 7, "output_length": 3}\n',
    )
    assert load_trace(jsonl) == [TraceRow(0.0, 9, 1), TraceRow(0.0, 8, 2), TraceRow(0.0025, 7, 3)]


_ROW = "2023-11-16 18:00:00.0000000"
_ROW2 = "2023-11-16 18:00:01.0000000"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"bad\.csv: empty file"),
        ("\r\n  \r\n", r"bad\.csv: empty file"),
        (f"{_HEADER}\r\n", r"bad\.csv:1: header only"),
        ("TIMESTAMP,ContextTokens\r\n" + f"{_ROW},5", r"bad\.csv:1: missing column 'GeneratedTokens'"),
        (
            f"{_HEADER}\r\n{_ROW},5,6\r\n{_ROW2},5,abc",
            r"bad\.csv:3: GeneratedTokens is not an integer: 'abc'",
        ),
        (f"{_HEADER}\r\n{_ROW},5.5,6", r"bad\.csv:2: ContextTokens is not an integer: '5\.5'"),
        (f"{_HEADER}\r\n{_ROW},,6", r"bad\.csv:2: ContextTokens is not an integer: ''"),
        (f"{_HEADER}\r\n{_ROW},-5,6", r"bad\.csv:2: ContextTokens must be >= 1, got -5"),
        (f"{_HEADER}\r\n{_ROW},0,6", r"bad\.csv:2: ContextTokens must be >= 1, got 0"),
        (f"{_HEADER}\r\n{_ROW},5,0", r"bad\.csv:2: GeneratedTokens must be >= 1, got 0"),
        (f"{_HEADER}\r\n{_ROW},5", r"bad\.csv:2: expected 3 fields like the header, got 2"),
        (f"{_HEADER}\r\nyesterday,5,6", r"bad\.csv:2: bad TIMESTAMP 'yesterday'"),
        (f"{_HEADER}\r\n-3.5,5,6", r"bad\.csv:2: bad TIMESTAMP '-3\.5'"),
        (
            f"{_HEADER}\r\n{_ROW},5,6\r\n12.5,5,6",
            r"bad\.csv:3: TIMESTAMP '12\.5' is seconds but the first row's is a date",
        ),
        (f"{_HEADER}\r\n2023-02-30 18:00:00.0,5,6", r"bad\.csv:2: bad TIMESTAMP .*no such date"),
        (f"{_HEADER}\r\n2023-11-16 25:00:00.0,5,6", r"bad\.csv:2: bad TIMESTAMP .*no such time of day"),
        (
            f"{_HEADER}\r\n{_ROW2},5,6\r\n{_ROW},5,6",
            r"bad\.csv:3: TIMESTAMP goes backwards .*must be sorted by time",
        ),
    ],
)
def test_malformed_azure_csv(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, "bad.csv", text))


_J = '{"timestamp": 0, "input_length": 5, "output_length": 6}\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"bad\.jsonl: empty file"),
        (_J + "{oops}\n", r"bad\.jsonl:2: not valid JSON"),
        (_J + "[1, 2, 3]\n", r"bad\.jsonl:2: expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 5}\n', r"bad\.jsonl:1: missing field 'output_length'"),
        ('{"input_length": 5, "output_length": 6}\n', r"bad\.jsonl:1: missing field 'timestamp'"),
        (
            '{"timestamp": 0, "input_length": 5.0, "output_length": 6}',
            r"bad\.jsonl:1: input_length is not an integer",
        ),
        (
            '{"timestamp": 0, "input_length": "5", "output_length": 6}',
            r"bad\.jsonl:1: input_length is not an integer",
        ),
        (
            '{"timestamp": 0, "input_length": true, "output_length": 6}',
            r"bad\.jsonl:1: input_length is not an integer",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 0}',
            r"bad\.jsonl:1: output_length must be >= 1, got 0",
        ),
        (
            '{"timestamp": 0, "input_length": -1, "output_length": 6}',
            r"bad\.jsonl:1: input_length must be >= 1, got -1",
        ),
        ('{"timestamp": "0", "input_length": 5, "output_length": 6}', r"bad\.jsonl:1: bad timestamp '0'"),
        ('{"timestamp": -3, "input_length": 5, "output_length": 6}', r"bad\.jsonl:1: bad timestamp -3"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 6}', r"bad\.jsonl:1: bad timestamp nan"),
        (
            '{"timestamp": 10, "input_length": 5, "output_length": 6}\n\n' + _J,
            r"bad\.jsonl:3: timestamp goes backwards \(0 ms is before the previous row's 10 ms\)",
        ),
    ],
)
def test_malformed_mooncake_jsonl(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, "bad.jsonl", text))


def test_trace_error_is_one_line_and_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_trace(_write(tmp_path, "bad.csv", f"{_HEADER}\r\n{_ROW},5,abc"))
    assert isinstance(info.value, TraceError)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- building workloads


def _prompt_arrays(requests: list) -> list[np.ndarray]:
    return [request.prompt_token_ids for request in requests]


def test_whole_trace_workload_matches_the_trace() -> None:
    rows = load_trace("azure-code")
    requests = build_workload(WorkloadConfig(trace="azure-code", max_tokens_mode="trace"), seed=0)
    assert [r.request_id for r in requests] == list(range(len(rows)))
    assert [r.arrival_s for r in requests] == [row.arrival_s for row in rows]
    assert [r.num_prompt_tokens for r in requests] == [row.prompt_tokens for row in rows]
    assert [r.target_output_tokens for r in requests] == [row.output_tokens for row in rows]
    assert [r.max_tokens for r in requests] == [row.output_tokens for row in rows]  # mode "trace"
    tokens = np.concatenate(_prompt_arrays(requests))
    assert tokens.dtype == np.int32
    assert tokens.min() >= 32 and tokens.max() <= 126


@pytest.mark.parametrize("rate_scale", [1.0, 2.0, 0.5])
def test_slice_and_rate_scale(rate_scale: float) -> None:
    start_s, duration_s = 600.0, 120.0
    rows = [row for row in load_trace("azure-conv") if start_s <= row.arrival_s < start_s + duration_s]
    cfg = WorkloadConfig(trace="azure-conv", start_s=start_s, duration_s=duration_s, rate_scale=rate_scale)
    requests = build_workload(cfg, seed=1)
    assert len(requests) == len(rows) > 0
    # re-based to the window's start, then divided by rate_scale
    expected = np.array([(row.arrival_s - start_s) / rate_scale for row in rows])
    np.testing.assert_allclose([r.arrival_s for r in requests], expected, rtol=0, atol=1e-9)
    assert all(0 <= r.arrival_s < duration_s / rate_scale for r in requests)
    assert [r.num_prompt_tokens for r in requests] == [row.prompt_tokens for row in rows]
    assert [r.target_output_tokens for r in requests] == [row.output_tokens for row in rows]


def test_num_requests_caps_after_slicing() -> None:
    cfg = WorkloadConfig(trace="azure-code", start_s=100.0, num_requests=50)
    requests = build_workload(cfg, seed=0)
    rows = [row for row in load_trace("azure-code") if row.arrival_s >= 100.0][:50]
    assert len(requests) == 50
    assert [r.num_prompt_tokens for r in requests] == [row.prompt_tokens for row in rows]


def test_empty_slice_is_an_error() -> None:
    with pytest.raises(TraceError, match=r"no requests in the slice \[5000, 5060\) s"):
        build_workload(WorkloadConfig(trace="azure-code", start_s=5000.0, duration_s=60.0), seed=0)


def _workload_fingerprint(requests: list) -> tuple:
    return tuple(
        (
            r.request_id,
            r.arrival_s,
            r.max_tokens,
            r.target_output_tokens,
            r.sla_level,
            r.prompt_token_ids.tobytes(),
        )
        for r in requests
    )


def test_same_seed_same_workload_other_seed_other_prompts() -> None:
    cfg = WorkloadConfig(trace="azure-conv", duration_s=300.0, arrival="gamma", max_tokens_mode="noisy")
    first = build_workload(cfg, seed=7)
    assert _workload_fingerprint(first) == _workload_fingerprint(build_workload(cfg, seed=7))
    other = build_workload(cfg, seed=8)
    assert len(other) == len(first)
    assert not any(
        np.array_equal(a, b) for a, b in zip(_prompt_arrays(first), _prompt_arrays(other), strict=True)
    )
    assert [r.arrival_s for r in first] != [r.arrival_s for r in other]


def test_random_streams_are_independent() -> None:
    """Changing one knob (SLA mix, max_tokens mode, arrival process) changes nothing else."""
    base = WorkloadConfig(trace="azure-code", duration_s=600.0)
    reference = build_workload(base, seed=3)
    for change in (
        {"sla_mix": {0: 0.5, 1: 0.3, 2: 0.2}},
        {"max_tokens_mode": "noisy"},
        {"arrival": "poisson"},
    ):
        changed = build_workload(base.model_copy(update=change), seed=3)
        for a, b in zip(reference, changed, strict=True):
            assert np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
            if "sla_mix" not in change:
                assert a.sla_level == b.sla_level
            if "max_tokens_mode" not in change:
                assert a.max_tokens == b.max_tokens
            if "arrival" not in change:
                assert a.arrival_s == b.arrival_s


def test_sla_mix_order_of_keys_does_not_matter() -> None:
    cfg = WorkloadConfig(trace="azure-code", num_requests=500, sla_mix={0: 0.7, 1: 0.3})
    swapped = cfg.model_copy(update={"sla_mix": {1: 0.3, 0: 0.7}})
    assert [r.sla_level for r in build_workload(cfg, 0)] == [r.sla_level for r in build_workload(swapped, 0)]


@pytest.mark.parametrize("mix", [{0: 0.8, 1: 0.2}, {0: 0.5, 1: 0.3, 2: 0.2}, {3: 1.0}])
def test_sla_mix_shares(mix: dict[int, float]) -> None:
    cfg = WorkloadConfig(trace="azure-conv", num_requests=10_000, sla_mix=mix)
    levels = np.array([r.sla_level for r in build_workload(cfg, seed=11)])
    assert set(levels.tolist()) <= set(mix)
    for level, share in mix.items():
        # binomial std at 10k draws is <= 0.005; 0.02 is four of them
        assert abs(np.mean(levels == level) - share) < 0.02


def test_max_tokens_modes() -> None:
    base = WorkloadConfig(trace="azure-conv", num_requests=3000, max_tokens_fixed=256)
    true = np.array([r.target_output_tokens for r in build_workload(base, 0)])
    assert true.max() > 256  # the clamp below is exercised

    fixed = build_workload(base.model_copy(update={"max_tokens_mode": "fixed"}), 0)
    assert {r.max_tokens for r in fixed} == {256}
    assert np.array_equal([r.target_output_tokens for r in fixed], true)

    noisy = build_workload(base.model_copy(update={"max_tokens_mode": "noisy", "max_tokens_noise": 0.5}), 0)
    budget = np.array([r.max_tokens for r in noisy])
    assert budget.min() >= 1 and budget.max() <= 256
    assert np.array_equal([r.target_output_tokens for r in noisy], true)
    unclamped = true < 100
    assert np.mean(budget[unclamped] != true[unclamped]) > 0.5  # noise really applied
    # lognormal(0, sigma) has median 1: the estimate is as often above the truth as below
    ratio = budget[unclamped] / true[unclamped]
    assert 0.85 < np.median(ratio) < 1.15

    exact = build_workload(base.model_copy(update={"max_tokens_mode": "noisy", "max_tokens_noise": 0.0}), 0)
    assert np.array_equal([r.max_tokens for r in exact], np.minimum(true, 256))


@pytest.mark.parametrize(("arrival", "rate_scale"), [("poisson", 1.0), ("poisson", 3.0), ("gamma", 2.0)])
def test_synthetic_arrivals_keep_the_trace_rate(arrival: str, rate_scale: float) -> None:
    cfg = WorkloadConfig(trace="azure-conv", arrival=arrival, rate_scale=rate_scale, gamma_cv=3.0)
    requests = build_workload(cfg, seed=5)
    arrivals = np.array([r.arrival_s for r in requests])
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert np.all(gaps >= 0)
    trace_rate = 19366 / 3501.721937
    expected_cv = 1.0 if arrival == "poisson" else 3.0
    # The mean of n gaps has relative std cv / sqrt(n) (0.7% poisson, 2.2% gamma at cv 3):
    # three sigmas, so an off-by-a-few-percent rate (e.g. a wrong span) fails.
    tolerance = 3 * expected_cv / np.sqrt(len(gaps))
    assert len(gaps) == 19366 and tolerance < 0.1  # the whole trace: the check discriminates
    measured_rate = 1 / gaps.mean()
    assert abs(measured_rate / (trace_rate * rate_scale) - 1) < tolerance
    # rate_scale divides the arrival times (same seed, same draws), so a workload asked to
    # run 3 bands faster is exactly that much faster, and the check above refuses it.
    factor = 1 + 3 * tolerance
    faster = build_workload(cfg.model_copy(update={"rate_scale": rate_scale * factor}), seed=5)
    faster_arrivals = np.array([r.arrival_s for r in faster])
    np.testing.assert_allclose(faster_arrivals * factor, arrivals, rtol=1e-9)
    assert abs(measured_rate * factor / (trace_rate * rate_scale) - 1) > tolerance
    assert gaps.std() / gaps.mean() == pytest.approx(expected_cv, rel=0.15)


def test_small_vocabulary_and_negative_seed() -> None:
    cfg = WorkloadConfig(trace="azure-code", num_requests=20)
    tokens = np.concatenate(_prompt_arrays(build_workload(cfg, seed=-1, vocab_size=16)))
    assert tokens.min() >= 0 and tokens.max() < 16
    assert _workload_fingerprint(build_workload(cfg, seed=-1)) != _workload_fingerprint(
        build_workload(cfg, seed=0)
    )
    with pytest.raises(ValueError, match="vocab_size"):
        build_workload(cfg, seed=0, vocab_size=0)


# ---------------------------------------------------------------- properties


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 requests over ~100 s with bursts of equal timestamps and lengths from 1 up."""
    rng = np.random.default_rng(0)
    gaps_ms = rng.choice([0, 0, 1, 250, 900, 2000], size=200)
    timestamps = np.cumsum(gaps_ms)
    lines = [
        f'{{"timestamp": {int(t)}, "input_length": {int(p)}, "output_length": {int(o)}}}'
        for t, p, o in zip(timestamps, rng.integers(1, 40, 200), rng.integers(1, 30, 200), strict=True)
    ]
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    start_s=st.floats(0, 120),
    duration_s=st.one_of(st.none(), st.floats(0.001, 200)),
    num_requests=st.one_of(st.none(), st.integers(1, 300)),
    rate_scale=st.floats(0.01, 100),
    arrival=st.sampled_from(["trace", "poisson", "gamma"]),
    gamma_cv=st.floats(0.1, 10),
    mode=st.sampled_from(["trace", "fixed", "noisy"]),
    seed=st.integers(-(2**63), 2**63 - 1),
)
def test_workload_invariants(
    small_trace: Path,
    start_s: float,
    duration_s: float | None,
    num_requests: int | None,
    rate_scale: float,
    arrival: str,
    gamma_cv: float,
    mode: str,
    seed: int,
) -> None:
    cfg = WorkloadConfig(
        trace=str(small_trace),
        start_s=start_s,
        duration_s=duration_s,
        num_requests=num_requests,
        rate_scale=rate_scale,
        arrival=arrival,
        gamma_cv=gamma_cv,
        max_tokens_mode=mode,
        max_tokens_fixed=16,
    )
    rows = load_trace(small_trace)
    end_s = np.inf if duration_s is None else start_s + duration_s
    num_in_window = sum(start_s <= row.arrival_s < end_s for row in rows)
    if num_in_window == 0:
        with pytest.raises(TraceError, match="no requests"):
            build_workload(cfg, seed)
        return
    requests = build_workload(cfg, seed)
    assert len(requests) == min(num_in_window, num_requests or num_in_window)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert all(np.isfinite(a) and a >= 0 for a in arrivals)
    assert [r.request_id for r in requests] == list(range(len(requests)))
    for r in requests:
        assert r.num_prompt_tokens >= 1 and r.max_tokens >= 1 and r.target_output_tokens >= 1
        assert r.prompt_token_ids.dtype == np.int32
    if arrival == "trace":
        assert all(a < (end_s - start_s) / rate_scale for a in arrivals)
