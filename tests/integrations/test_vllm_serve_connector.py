"""preempt's KV connector in the peer's own `vllm serve`, over HTTP: the documented
command (plugin + `--kv-transfer-config` naming the connector by module path) starts, the
same forced-preemption requests go to plain vLLM (recompute; the connector only counts)
and to the plugin with raw copies through the openai client, greedy outputs are equal,
preempted requests resume from the host pool (loads > 0, fewer tokens recomputed), the
connector's families are on `/metrics` (the cost rule's choices too), SIGTERM drains
cleanly. Skipped without a peer
unless PREEMPT_REQUIRE_PEER=1 (CI), like tests/parity.
"""

from __future__ import annotations

import pytest

from preempt.bench.vllm_connector import CONNECTOR_ARMS, forced_preemptions, run_connector_arms
from preempt.bench.vllm_http import ENGINE, write_model
from tests.parity.test_vllm_parity import peer  # noqa: F401 - the shared fixture

REQUESTS = forced_preemptions("long", num=8)


@pytest.fixture(scope="module")
def served(peer, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("vllm-serve-connector")
    model = write_model(peer, work / "model")
    arms = [arm for arm in CONNECTOR_ARMS if arm.name in ("vllm", "plugin_raw", "plugin_raw_cost")]
    # float32: greedy outputs are compared token for token (tests/integrations/test_vllm_serve.py)
    results = run_connector_arms(
        peer.parent / "vllm", model, arms, {"long": [REQUESTS]}, work, {**ENGINE, "dtype": "float32"}
    )
    return {result["name"]: {**result, **result["runs"]["long"][0]} for result in results}


def test_documented_command_serves_every_request_and_stops_cleanly(served):
    for result in served.values():
        assert result["exit_code"] == 0, result["name"]
        assert [len(r["token_ids"]) for r in result["requests"]] == [r.max_tokens for r in REQUESTS]
    command = served["plugin_raw"]["command"]
    assert "--scheduler-cls" in command and "--kv-transfer-config" in command
    assert "preempt.integrations.vllm.connector" in command[command.index("--kv-transfer-config") + 1]


def test_raw_copies_give_plain_vllms_tokens_with_less_recomputed(served):
    plain, raw = served["vllm"], served["plugin_raw"]
    assert [r["token_ids"] for r in raw["requests"]] == [r["token_ids"] for r in plain["requests"]]
    assert plain["counters"]["vllm:num_preemptions_total"] > 0
    assert raw["counters"]["preempt:kv_loads_total"] > 0
    assert raw["recomputed_tokens"] < plain["recomputed_tokens"]


def test_connector_families_on_metrics(served):
    counters = served["plugin_raw"]["counters"]
    for family in ("preempt:kv_saves_total", "preempt:kv_stored_bytes_total",
                   "preempt:kv_loaded_tokens_total",
                   "preempt:kv_save_seconds_count", "preempt:kv_load_seconds_sum"):  # fmt: skip
        assert family in counters, family
    assert any(key.startswith("preempt:kv_fallbacks_total{reason=") for key in counters)
    assert counters["preempt:kv_save_seconds_count"] == counters["preempt:kv_saves_total"]


def test_the_cost_rules_choices_and_measurements_on_metrics(served):
    cost = served["plugin_raw_cost"]["counters"]
    choices = {k: v for k, v in cost.items() if k.startswith("preempt:kv_cost_choices_total{choice=")}
    assert set(choices) >= {f"preempt:kv_cost_choices_total{{choice={c}}}" for c in ("save", "recompute")}
    # every victim with a whole block to copy got a choice; each recompute is a cost fallback
    assert sum(choices.values()) > 0
    recomputed = cost.get("preempt:kv_fallbacks_total{reason=cost}", 0)
    assert recomputed == choices["preempt:kv_cost_choices_total{choice=recompute}"]
    assert cost["preempt:kv_prefill_tokens_total"] > 0 and cost["preempt:kv_saved_tokens_total"] > 0
    # nothing to choose under `saves: all`
    assert sum(v for k, v in served["plugin_raw"]["counters"].items() if "cost_choices" in k) == 0
