"""preempt's policy as a vLLM 0.32 scheduler plugin, run in the peer virtualenv.

One peer subprocess per module: the plugin driven without a model beside preempt's own
engine on bundled parity workloads (same decisions, step by step), and a real `vllm.LLM`
on a tiny random-weight Llama under vLLM's fcfs scheduler and under the plugin (same
greedy tokens for every request; the top class's first tokens much earlier). Skipped
without a peer unless PREEMPT_REQUIRE_PEER=1 (CI), like tests/parity.
"""

from __future__ import annotations

import pytest

from preempt.bench.vllm import PEER_MODULE, decision_jobs, llm_job, summarize_decisions, ttft_by_class
from preempt.parity.harness import run_vllm
from tests.parity.test_vllm_parity import peer  # noqa: F401 - the shared fixture

WORKLOADS = ("priority-mix", "burst-tight")


@pytest.fixture(scope="module")
def peer_run(peer, tmp_path_factory):  # noqa: F811
    jobs, ours = decision_jobs(WORKLOADS)
    # The same policy on vLLM's AsyncScheduler (what the plugin runs where vLLM schedules
    # asynchronously), on the workload that exercises every seam.
    async_jobs, async_ours = decision_jobs(WORKLOADS[:1], ("plugin_defaults",), async_scheduler=True)
    job = llm_job(tmp_path_factory.mktemp("tiny-llama"), quick=True)
    job["arms"] = [arm for arm in job["arms"] if arm["name"] in ("vllm_fcfs", "plugin")]
    report = run_vllm([*jobs, *async_jobs, job], peer, module=PEER_MODULE)
    *decisions, llm = report["results"]
    assert "error" not in llm, llm.get("error")
    return {
        "decisions": summarize_decisions(decisions[: len(jobs)], ours),
        "async_decisions": summarize_decisions(decisions[len(jobs) :], async_ours),
        "arms": {a["name"]: a for a in llm["arms"]},
    }


def test_plugin_makes_preempts_decisions_step_by_step(peer_run):
    for row in peer_run["decisions"]:
        assert "error" not in row, row
        assert row["identical"], (row["workload"], row["first_divergence"])
    mix = {row["settings"]: row for row in peer_run["decisions"] if row["workload"] == "priority-mix"}
    # The workload exercises what the plugin adds, not only vLLM's memory preemption: under
    # its own defaults priority preemptions and fallbacks; under the engine's (memory
    # preemptions fill the cap) the rate cap too.
    for variant in ("plugin_defaults", "engine_defaults"):
        assert mix[variant]["plugin_metrics"]["preemptions"]["priority"] > 0
        assert mix[variant]["plugin_metrics"]["failures"]["consecutive_limit"] > 0
    assert mix["engine_defaults"]["plugin_metrics"]["rate_limited"] > 0


def test_the_plugin_on_vllms_async_scheduler_decides_the_same(peer_run):
    (row,) = peer_run["async_decisions"]
    assert "error" not in row, row
    assert row["identical"], (row["workload"], row["first_divergence"])
    assert row["plugin_metrics"]["preemptions"]["priority"] > 0


def test_greedy_outputs_equal_vllm_default_for_every_request(peer_run):
    fcfs, plugin = peer_run["arms"]["vllm_fcfs"], peer_run["arms"]["plugin"]
    reference = {r["id"]: r["token_ids"] for r in fcfs["requests"]}
    assert plugin["preemptions"] > 0  # order really changed: requests were preempted and recomputed
    for r in plugin["requests"]:
        assert (
            len(r["token_ids"])
            == next(s for s in fcfs["requests"] if s["id"] == r["id"])["token_ids"].__len__()
        )
        assert r["token_ids"] == reference[r["id"]], r["id"]


def test_top_class_first_tokens_earlier_than_fcfs(peer_run):
    fcfs = ttft_by_class(peer_run["arms"]["vllm_fcfs"])["priority_0"]
    plugin = ttft_by_class(peer_run["arms"]["plugin"])["priority_0"]
    assert plugin <= 0.5 * fcfs, (plugin, fcfs)


def test_plugin_metrics_beside_vllms_own_counter(peer_run):
    plugin = peer_run["arms"]["plugin"]
    prom = plugin["prometheus"]
    counted = plugin["preemptions"]
    assert prom["vllm:num_preemptions_total"] == counted
    by_reason = sum(v for k, v in prom.items() if k.startswith("preempt:preemptions_total"))
    assert by_reason == counted == plugin["plugin"]["num_preemptions"]
    assert prom["preempt:recomputed_tokens_total"] == plugin["recomputed_tokens"]
