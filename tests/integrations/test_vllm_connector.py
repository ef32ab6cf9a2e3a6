"""preempt's KV connector inside vLLM 0.32 (a real `vllm.LLM` in the peer, engine core
in-process): requests preempted for memory resume from the host pool instead of
recomputing. One peer subprocess for every arm on the same forced-preemption workload
(prompts of 160 tokens, 24 blocks of 32, 8 seats): plain vLLM (recompute), the plugin with
the connector in raw, fp8 and mixed modes, with synchronous loads, with early copies, with
a host pool too small for a copy, with a copy corrupted before its load, with stores and
loads slowed (a resume while a store is in flight, a client gone during a load), and an
urgent class preempted while a lower one waits (vLLM #41951). Skipped without a peer
unless PREEMPT_REQUIRE_PEER=1 (CI), like tests/parity.
"""

from __future__ import annotations

import random

import pytest

from preempt.bench.vllm import PEER_MODULE
from preempt.integrations.vllm.settings import PLUGIN_CLS  # noqa: F401 - the plugin the arms name
from preempt.parity.harness import run_vllm
from tests.parity.test_vllm_parity import peer  # noqa: F401 - the shared fixture

ENGINE = {"block_size": 32, "num_gpu_blocks": 24, "max_model_len": 512, "max_num_seqs": 8,
          "max_num_batched_tokens": 256, "dtype": "float32"}  # fmt: skip


def forced_preemptions(
    num: int = 12, prompt: int = 160, output: int = 120, seed: int = 0, shared_prefix: int = 0
) -> list[dict]:
    """Every request at step 0: the 8 seats' sequences outgrow 24 blocks within a few
    dozen steps, so vLLM preempts again and again. `shared_prefix`: the first tokens of
    every prompt are the same (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(32, 127) for _ in range(shared_prefix)]
    return [
        {"id": i, "priority": 0, "arrival_step": 0, "max_tokens": output,
         "prompt_token_ids": prefix + [rng.randrange(32, 127) for _ in range(prompt - shared_prefix)]}
        for i in range(num)
    ]  # fmt: skip


ABORTED = {1: 20, 4: 40, 7: 60, 10: 80}  # request id -> the step its client goes away
ABORTED_LOADING = {0, 3, 6, 9}  # these go away when their KV is first being loaded


def arm(name: str, **connector) -> dict:
    out = {"name": name, "scheduler": "preempt", "policy": "priority", "settings": {}, "connector": connector}
    if connector.pop("corrupt", False):
        out.update(connector_module="tests.integrations.vllm_faults", connector_cls="CorruptingConnector")
    if connector.pop("slow_store", False):
        out.update(connector_module="tests.integrations.vllm_faults", connector_cls="SlowStoringConnector")
    if connector.pop("slow_load", False):
        out.update(connector_module="tests.integrations.vllm_faults", connector_cls="SlowLoadingConnector")
    if connector.pop("broken_load", False):
        out.update(connector_module="tests.integrations.vllm_faults", connector_cls="BrokenLoadingConnector")
    return out


@pytest.fixture(scope="module")
def arms(peer, tmp_path_factory):  # noqa: F811
    job = {
        "kind": "llm",
        "model": "served",
        "model_dir": str(tmp_path_factory.mktemp("served")),
        "engine": ENGINE,
        "requests": forced_preemptions(),
        "arms": [
            {"name": "vllm", "scheduler": "default", "policy": "fcfs"},
            {
                "name": "vllm_counted",
                "scheduler": "default",
                "policy": "fcfs",
                "connector": {"saves": "none"},
            },
            {"name": "plugin", "scheduler": "preempt", "policy": "priority", "settings": {}},
            arm("raw", codec="raw"),
            arm("raw_sync", codec="raw", loads="sync"),
            arm("fp8", codec="fp8"),
            arm("mixed", codec="mixed"),
            arm("raw_early", codec="raw", early=True),
            arm("full_pool", codec="raw", host_pool="64KiB", slot_size="64KiB"),
            arm("corrupt", codec="raw", corrupt=True),
            arm("corrupt_sync", codec="raw", loads="sync", corrupt=True),
            arm("broken_load", codec="raw", broken_load=True),
            arm("slow_store", codec="raw", slow_store=True),
        ],
    }
    # vLLM's prefix cache on: loaded blocks meet cached ones; lossy ones must not be cached
    cached = {
        **job,
        "engine": {**ENGINE, "prefix_caching": True},
        "requests": forced_preemptions(num=10, shared_prefix=64),
        "arms": [
            {"name": "vllm_prefix", "scheduler": "default", "policy": "fcfs"},
            arm("raw_prefix", codec="raw"),
            arm("fp8_prefix", codec="fp8"),
        ],
    }
    # clients that go away mid-run, while their requests run, wait preempted, or wait for a
    # copy still being stored: the others finish as before, nothing is left behind
    requests = forced_preemptions()
    for request in requests:
        if request["id"] in ABORTED:
            request["abort_step"] = ABORTED[request["id"]]
    aborted = {
        **job,
        "requests": requests,
        "arms": [arm("abort_raw", codec="raw"), arm("abort_slow_store", codec="raw", slow_store=True)],
    }
    # clients that go away while their KV is being loaded (slowed: the load thread is still
    # writing the blocks vLLM gave them)
    requests = forced_preemptions()
    for request in requests:
        request["abort_loading"] = request["id"] in ABORTED_LOADING
    aborted_loading = {
        **job,
        "requests": requests,
        "arms": [arm("abort_loading", codec="raw", slow_load=True)],
    }
    # the urgent class preempted for memory while a lower class waits, queued before it
    # (vLLM #41951): a victim re-enters the queue with its own class
    requests = [{**r, "priority": 3} for r in forced_preemptions(num=4, seed=1)]
    requests += [{**r, "id": 4 + r["id"]} for r in forced_preemptions(num=8, seed=2)]
    readmission = {
        **job,
        "requests": requests,
        "arms": [
            {"name": "readmit_plugin", "scheduler": "preempt", "policy": "priority", "settings": {}},
            arm("readmit_raw_sync", codec="raw", loads="sync"),
        ],
    }
    report = run_vllm([job, cached, aborted, aborted_loading, readmission], peer, module=PEER_MODULE)
    for result in report["results"]:
        assert "error" not in result, result.get("error")
    return {a["name"]: a for result in report["results"] for a in result["arms"]}


def outputs(arm: dict) -> dict[int, list[int]]:
    return {r["id"]: r["token_ids"] for r in arm["requests"]}


def metric(arm: dict, name: str) -> float:
    return sum(v for k, v in arm["prometheus"].items() if k.split("{")[0] == name)


@pytest.mark.parametrize("name", ["raw", "raw_sync"])  # loads asynchronous (default), synchronous
def test_raw_copies_resume_preempted_requests_with_plain_vllms_tokens(arms, name):
    raw, plain = arms[name], arms["vllm"]
    assert plain["preemptions"] > 5 and raw["preemptions"] > 5
    assert outputs(raw) == outputs(plain)  # lossless: token for token
    saves, loads = metric(raw, "preempt:kv_saves_total"), metric(raw, "preempt:kv_loads_total")
    assert loads >= 0.9 * raw["preemptions"] and loads <= saves
    # recomputed = dropped at preemption - loaded back; only each resume's partial last block
    recomputed = raw["recomputed_tokens"] - metric(raw, "preempt:kv_loaded_tokens_total")
    assert recomputed <= 0.2 * plain["recomputed_tokens"]


def test_asynchronous_loads_keep_the_request_out_of_the_batch_until_loaded(arms):
    # async: vLLM gives a resumed request its blocks and parks it (WAITING_FOR_REMOTE_KVS)
    # while the load thread fills them during other requests' steps, then admits it; sync:
    # the copy is decoded before the forward pass of the step that resumes it
    for name, parked in (("raw", True), ("raw_sync", False)):
        victims = [r for r in arms[name]["requests"] if r["preempted_steps"]]
        assert victims, name
        for r in victims:
            assert len(r["admitted_steps"]) == len(r["preempted_steps"]) + 1, name  # each ran again
        assert (sum(r["loading_steps"] for r in victims) > 0) == parked, name


def test_a_counting_connector_changes_nothing(arms):
    # the HTTP bench's plain arm: vLLM's scheduler with the connector only counting
    plain, counted = arms["vllm"], arms["vllm_counted"]
    assert (counted["steps"], counted["preemptions"]) == (plain["steps"], plain["preemptions"])
    assert outputs(counted) == outputs(plain)
    assert metric(counted, "preempt:kv_preempted_tokens_total") == plain["recomputed_tokens"]
    assert metric(counted, "preempt:kv_saves_total") == 0


def test_lossy_copies_save_bytes_and_finish_every_request(arms):
    plain = outputs(arms["vllm"])
    for name in ("fp8", "mixed"):
        got = outputs(arms[name])
        assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in plain.items()}
        assert metric(arms[name], "preempt:kv_loads_total") > 0


def test_early_copies_are_used(arms):
    early = arms["raw_early"]
    assert outputs(early) == outputs(arms["vllm"])
    assert metric(early, "preempt:kv_early_tokens_total") > 0  # the projection named victims ahead
    assert metric(early, "preempt:kv_loads_total") > 0


def test_full_pool_falls_back_to_recompute(arms):
    full = arms["full_pool"]
    assert outputs(full) == outputs(arms["vllm"])
    assert metric(full, "preempt:kv_fallbacks_total") > 0
    assert metric(full, "preempt:kv_loads_total") == 0


@pytest.mark.parametrize("name", ["corrupt", "corrupt_sync"])
def test_corrupt_copy_is_recomputed_and_the_request_finishes(arms, name):
    corrupt = arms[name]
    assert outputs(corrupt) == outputs(arms["vllm"])  # the checksum caught it: recomputed, not garbage
    fallbacks = {k: v for k, v in corrupt["prometheus"].items() if k.startswith("preempt:kv_fallbacks_total")}
    assert fallbacks.get("preempt:kv_fallbacks_total{reason=corrupt}", 0) > 0
    assert metric(corrupt, "preempt:kv_loads_total") > 0  # the others loaded


def test_a_load_that_raises_is_recomputed_and_the_engine_keeps_serving(arms):
    broken = arms["broken_load"]
    assert outputs(broken) == outputs(arms["vllm"])
    assert broken["prometheus"].get("preempt:kv_fallbacks_total{reason=load}", 0) > 0
    assert metric(broken, "preempt:kv_loads_total") > 0  # every other one loaded


def test_resuming_while_a_copy_is_still_stored_waits_then_loads(arms):
    slow = arms["slow_store"]
    assert metric(slow, "preempt:kv_resume_waits_total") > 0  # vLLM was ready before the store was
    assert outputs(slow) == outputs(arms["vllm"])  # never admitted on a half-stored copy
    assert metric(slow, "preempt:kv_loads_total") > 0


def test_aborted_clients_leave_the_others_as_they_were(arms):
    plain = outputs(arms["vllm"])
    for name in ("abort_raw", "abort_slow_store"):
        run = arms[name]
        aborted = {r["id"] for r in run["requests"] if r["aborted"]}
        assert aborted == set(ABORTED), name  # each went away before it finished
        kept = {k: v for k, v in outputs(run).items() if k not in aborted}
        assert kept == {k: v for k, v in plain.items() if k not in aborted}, name
        assert all(r["finish_step"] is not None for r in run["requests"]), name
        assert metric(run, "preempt:kv_loads_total") > 0, name


def test_a_client_gone_during_a_load_frees_nothing_early(arms):
    # vLLM keeps an aborted request's blocks until the connector reports its load finished
    # (the load thread still writes them); the others' tokens show no block was reused early
    run, plain = arms["abort_loading"], outputs(arms["vllm"])
    gone = {r["id"]: r["aborted_while"] for r in run["requests"] if r["aborted"]}
    assert gone and set(gone) <= ABORTED_LOADING
    assert set(gone.values()) == {"WAITING_FOR_REMOTE_KVS"}
    kept = {k: v for k, v in outputs(run).items() if k not in gone}
    assert kept == {k: v for k, v in plain.items() if k not in gone}
    assert all(r["finish_step"] is not None for r in run["requests"])
    assert metric(run, "preempt:kv_loads_total") > len(gone)  # the aborted ones' loads, and others


@pytest.mark.parametrize("name", ["readmit_plugin", "readmit_raw_sync"])
def test_a_preempted_request_keeps_its_priority_when_readmitted(arms, name):
    # vLLM #41951: a victim back in the queue must not fall behind requests it outranks.
    # The plugin ranks victims by rewriting `request.priority` inside schedule(); the queue
    # keys a victim by its own class, so no priority-3 request starts while a preempted
    # priority-0 one waits
    run = arms[name]
    urgent = [r for r in run["requests"] if r["priority"] == 0]
    low_starts = [r["admitted_steps"][0] for r in run["requests"] if r["priority"] == 3]
    waits = [
        (at, min(s for s in r["admitted_steps"] if s > at)) for r in urgent for at in r["preempted_steps"]
    ]
    assert waits, "no urgent request was preempted: the workload no longer tests this"
    assert min(low_starts) > min(at for at, _ in waits)  # the low class was waiting meanwhile
    for preempted_at, back_at in waits:
        assert not [s for s in low_starts if preempted_at < s < back_at], (preempted_at, back_at, low_starts)


def test_with_vllms_prefix_cache(arms):
    plain, raw, fp8 = arms["vllm_prefix"], arms["raw_prefix"], arms["fp8_prefix"]
    assert raw["preemptions"] > 0 and metric(raw, "preempt:kv_loads_total") > 0
    assert outputs(raw) == outputs(plain)  # raw copies and cached blocks mix losslessly
    assert metric(fp8, "preempt:kv_loads_total") > 0
    assert {k: len(v) for k, v in outputs(fp8).items()} == {k: len(v) for k, v in outputs(plain).items()}
