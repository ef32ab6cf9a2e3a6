"""`preempt bench fidelity --loads`: the KV connector's asynchronous loads against
synchronous ones. The judge on a made-up step log (what counts as a resume step), and
the bench end to end on its smoke setup (the tiny model, one short window, both servers
real). Checks the pipeline, not the timing (that is the bench's measurement:
docs/vllm_plugin.md). The end-to-end part is skipped without the peer unless
PREEMPT_REQUIRE_PEER=1 (CI)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from preempt.bench.fidelity import window_requests
from preempt.bench.vllm_loads import (
    ARMS,
    QUICK,
    _resume_excess,
    _steps,
    bench_loads,
    rejudge_loads,
    render_loads,
)
from preempt.cli import main
from tests.parity.test_vllm_parity import peer  # noqa: F401 - the shared fixture


def step(t: float, ids: list[str], preempted: list[str] = (), seconds: float = 0.01) -> dict:
    return {"t": t, "end": t + seconds, "ids": ids, "chunks": [[0, 1]] * len(ids),
            "preempted": [[rid, 64] for rid in preempted]}  # fmt: skip


def test_a_resume_step_is_the_first_a_victim_runs_in_again_and_its_excess_is_measured():
    log = SimpleNamespace(
        steps=[
            step(0.0, ["w-00000", "w-00001"], seconds=0.012),
            step(1.0, ["w-00000"], preempted=["w-00001", "x-00002"], seconds=0.011),  # x-: another window's
            step(2.0, ["w-00000"], seconds=0.011),
            step(3.0, ["w-00000", "w-00001"], seconds=0.017),  # w-00001 back: a resume step
            step(4.0, ["w-00000", "w-00001"], seconds=0.012),
            step(4.5, ["w-00000", "w-00001", "w-00003"], seconds=0.013),
            step(9.0, ["x-00002"]),  # after the window's run
        ]
    )
    steps = _steps(log, {"started": 0.0, "ended": 5.0}, "w")
    assert [flag for _, flag in steps] == [False, False, False, True, False, False]
    # the other steps: 10 ms + 1 ms a request, so a 2-request step beyond 12 ms is the load's
    assert _resume_excess(steps) == [pytest.approx(0.005, abs=1e-9)]


@pytest.fixture(scope="module")
def bench(peer, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("loads")
    return work, bench_loads(peer, work, quick=True)


def test_both_arms_served_every_request_with_copies_loaded(bench):
    work, result = bench
    (window,) = result["windows"]
    real = json.loads((work / "real.json").read_text())["real"]
    wanted = {r.index: r.output_tokens for r in window_requests(QUICK, QUICK.judge_starts[0])}
    for loads in ARMS:
        records = real[f"raw_{loads}"]["windows"][window]["records"]
        assert {r["id"]: len(r["token_ids"]) for r in records} == wanted
        row = result["arms"][loads]
        assert row["preemptions"] > 0 and row["loads"] > 0 and row["steps"] > 0
        assert f'"loads": "{loads}"' in " ".join(real[f"raw_{loads}"]["command"])
    # lossless copies: the same greedy tokens whichever way they were loaded
    by_arm = [{r["id"]: r["token_ids"] for r in real[f"raw_{loads}"]["windows"][window]["records"]}
              for loads in ARMS]  # fmt: skip
    assert by_arm[0] == by_arm[1]
    assert "mean step, async minus sync" in render_loads(result)


def test_judging_again_gives_the_same_result_and_the_cli_writes_it(bench, tmp_path, capsys):
    work, result = bench
    assert rejudge_loads(work)["arms"] == result["arms"]
    assert main(["bench", "fidelity", "--loads", "--real", str(work), "--out", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arms"] == json.loads(json.dumps(result["arms"]))
    assert (tmp_path / "loads.md").read_text().startswith("| loads |")
    assert main(["bench", "fidelity", "--loads", "--connector"]) == 2


def test_the_readme_and_docs_quote_the_kept_runs():
    """The README's async-against-sync step ratio is the one both kept runs' windows give
    together, and each run's kept result is what judging its step logs again gives."""
    from pathlib import Path

    from preempt.obs.stats import ratio_interval

    root = Path(__file__).resolve().parents[2]
    runs = [root / "benchmarks/loads_2026-12-08" / name for name in ("run1", "run2")]
    kept = [json.loads((run / "loads.json").read_text()) for run in runs]
    for run, result in zip(runs, kept, strict=True):
        assert rejudge_loads(run)["step_ratio"] == result["step_ratio"]
    pooled = ratio_interval(
        [v for r in kept for v in r["step_s_by_window"]["async"]],
        [v for r in kept for v in r["step_s_by_window"]["sync"]],
    )
    quoted = f"{pooled.mean:.3f} [{pooled.lo:.3f}, {pooled.hi:.3f}]"
    assert quoted == "0.990 [0.961, 1.022]"
    readme = " ".join((root / "README.md").read_text().split())
    docs = " ".join((root / "docs/vllm_plugin.md").read_text().split())
    assert f"mean step time ratio {quoted} over their ten windows" in readme
    assert f"ratio {quoted}" in docs
    for result in kept:
        ratio = result["step_ratio"]
        assert f"(ratio {ratio['mean']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3g}])" in docs
