"""`preempt bench peers --vidur`: the same requests through preempt and Vidur.

The Vidur replay needs Vidur's virtualenv (`make vidur`); it is skipped without one, except
where PREEMPT_REQUIRE_VIDUR=1 (`make test`, CI) turns that into a failure."""

import csv
import json
import os

import numpy as np
import pytest

from preempt.bench.peers import bench_peers, render_peers, vidur_python
from preempt.bench.vidur_peer import TRACE_DATE, percentiles, write_trace
from preempt.cli import main
from preempt.parity.harness import PeerError


def test_percentiles_are_numpy_linear_ones():
    values = list(np.random.default_rng(0).exponential(size=101))
    got = percentiles(values)
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert got[name] == pytest.approx(np.percentile(values, q))
    assert got["mean"] == pytest.approx(np.mean(values))
    assert percentiles([])["p50"] is None


def test_vidur_trace_holds_the_requests_unscaled(tmp_path):
    path = tmp_path / "trace.csv"
    write_trace([[0.0, 12, 3], [1.25, 700, 1024]], path)
    fields = ("Date", "Time", "PromptTokenCount", "CompletionTokenCount")
    rows = [tuple(row[f] for f in fields) for row in csv.DictReader(path.open())]
    assert rows == [(TRACE_DATE, "0.0", "12", "3"), (TRACE_DATE, "1.25", "700", "1024")]


def test_bench_peers_refuses_without_its_peer(monkeypatch, tmp_path, capsys):
    assert main(["bench", "peers"]) == 2
    assert "needs a peer: --vidur" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: `bench engine` takes no --vidur
        main(["bench", "engine", "--vidur"])
    assert exc.value.code == 2
    assert "preempt bench engine: error: unrecognized arguments: --vidur" in capsys.readouterr().err
    monkeypatch.setenv("PREEMPT_VIDUR_PYTHON", str(tmp_path / "none" / "python"))
    assert main(["bench", "peers", "--vidur"]) == 2
    assert "run `make vidur`" in capsys.readouterr().err


@pytest.fixture(scope="module")
def vidur():
    try:
        return vidur_python()
    except PeerError as err:
        if os.environ.get("PREEMPT_REQUIRE_VIDUR") == "1":
            pytest.fail(f"PREEMPT_REQUIRE_VIDUR=1 but {err}")
        pytest.skip(str(err))


def test_vidur_replays_the_same_requests_and_crashes_at_its_first_restart_unless_fixed(vidur, tmp_path):
    result = bench_peers(vidur, rate_scales=(1.0,), cache_dir=tmp_path / "cache", minutes=3)
    json.dumps(result)  # what --json prints
    (point,) = result["points"]
    ours, shipped, fixed = point["preempt"], point["vidur"], point["vidur_restart_fixed"]
    assert shipped["num_requests"] == fixed["num_requests"] == ours["num_requests"] > 500
    assert ours["num_completed"] == ours["num_requests"] and ours["num_preemptions"] > 0
    # the fix lets every request finish, through restarts (Vidur's preemptions)
    assert "error" not in fixed and fixed["num_completed"] == fixed["num_requests"]
    assert fixed["num_restarts"] > 0 and fixed["restart_patched"]
    # as shipped, the first restart trips the stage counter it keeps
    assert "_num_stage_processed_tokens" in shipped["error_where"]
    assert shipped["num_completed"] < shipped["num_requests"]
    # the same deployment on both clocks: a decode step's time per token agrees
    assert fixed["tpot_s"]["p50"] == pytest.approx(ours["tpot_s"]["p50"], rel=0.25)
    table = render_peers(result)
    assert "Vidur, restart fixed" in table and "rate_scale 1.0" in table
