"""Early (speculative) saves: incremental copies restore bit-identical KV, outputs of
lossless modes never change, wasted copies stay within the speculation budget, and the
policies pick whom they should."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from preempt.core.config import ConfigError, EarlySaveConfig
from preempt.core.request import RequestState
from preempt.early.early_save import OraclePolicy, RulePolicy, WasteCap, load_preemption_times
from preempt.early.features import FEATURE_NAMES
from preempt.engine.engine import Engine
from tests.conftest import make_request, small_config
from tests.kv.test_preemption import AGGRESSIVE, _digests, _run, _workload


def _logical_kv(engine, request, num_tokens):
    bs = engine.block_size
    blocks = engine.runner.kv_cache.read_blocks(request.block_ids[: -(-num_tokens // bs)])
    return blocks.flatten(2, 3)[:, :, :num_tokens].clone()


@pytest.mark.parametrize("mode", ["swap", "swap_zstd", "swap_mixed"])
def test_incremental_early_saves_plus_tail_restore_bit_identical_kv(mode):
    engine = Engine(small_config(preemption={"mode": mode, "codecs": {"mixed": {"plan": "fp16"}}}))
    saver, pool = engine.saver, engine.block_pool
    request = make_request(0, 21, 60)
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert saver.early_save(request, 0.0)  # 1st snapshot: the full blocks so far
    assert not saver.early_save(request, 0.0)  # nothing new since
    first = saver.early._segments[request][0].num_tokens
    for _ in range(9):
        engine.step()
    assert saver.early_save(request, 0.0)  # 2nd: only the blocks written since
    segments = saver.early._segments[request]
    assert [s.start for s in segments] == [0, first] and segments[1].num_tokens > 0
    for _ in range(3):
        engine.step()
    num_tokens = request.num_computed_tokens
    assert num_tokens % engine.block_size != 0  # a tail with a partial block
    before = _logical_kv(engine, request, num_tokens)
    codec = {"swap": "raw", "swap_zstd": "zstd", "swap_mixed": "mixed"}[mode]
    saved = saver.save(request, codec, 0.0)
    assert saved.failure is None
    covered = sum(s.num_tokens for s in segments)
    assert saved.bytes_early == saver.early.early_bytes_used > 0
    assert saved.bytes_raw == saver._raw_bytes(num_tokens - covered)  # only the tail was copied now
    # the stored size covers the early segments and the tail
    assert saved.bytes_stored.result() == sum(s.stored.result() for s in saver._saved[request].segments) > 0
    old = request.block_ids
    engine.runner.kv_cache.kv[:, :, old] = float("nan")
    pool.free(old)
    request.block_ids = pool.allocate(len(old))
    assert saver.restore(request, 0.0).ok
    assert torch.equal(_logical_kv(engine, request, num_tokens), before)
    assert saver.host_pool.num_used_slots == 0 and saver.early.speculative_bytes == 0
    assert saver.early.early_bytes_wasted == 0


@pytest.mark.parametrize("mode", ["swap_zstd", "pause"])
def test_write_through_early_saves_change_no_output(mode):
    _, unpreempted_requests = _run("recompute", policy="vllm_fcfs")
    unpreempted = _digests(unpreempted_requests)
    engine, requests = _run(mode, num_blocks=30 if mode == "pause" else 256, early={"policy": "always"})
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == unpreempted
    saver = engine.saver
    assert saver.early.num_early_saves > 0 and saver.early.early_bytes_used > 0
    claimed = [r for r in engine.scheduler.records if r.bytes_early]
    assert claimed and all(r.restored for r in claimed)
    # Every early byte is accounted for: claimed by a preemption or wasted (finish/evict).
    assert saver.early.early_bytes_used + saver.early.early_bytes_wasted == saver.early.early_bytes_raw
    assert saver.early.speculative_bytes == 0 and saver.host_pool.num_used_slots == 0
    saver.host_pool.check()


def test_speculation_never_holds_more_than_its_budget():
    # Wrong predictions (here: every request, none ever preempted) waste host memory only
    # within the budget, and all of it is given back.
    engine = Engine(
        small_config(preemption={"mode": "swap"}, early_save={"policy": "always", "host_budget": 20000})
    )
    saver = engine.saver
    requests = [make_request(i, 30, 40) for i in range(4)]
    for request in requests:
        engine.add_request(request)
    peak = 0
    while any(not r.state.is_final for r in requests):
        engine.step()
        peak = max(peak, saver.early.speculative_bytes)
        assert saver.early.speculative_bytes <= 20000  # 2 blocks of 8 KB fit, 3 do not
    assert peak > 0
    assert saver.early.early_bytes_wasted == saver.early.early_bytes_raw  # nobody was preempted: all wasted
    assert saver.host_pool.num_used_slots == 0


def test_demand_saves_evict_speculative_copies_when_the_pool_is_full():
    # 4 slots: early copies of running requests fill them; a preemption's save must still
    # find room (the early copies of others are evicted, counted as wasted).
    engine, requests = _run(
        "swap", host_mem="64KB", slot_size="16KB", early={"policy": "always", "max_inflight": 64}
    )
    saver = engine.saver
    assert saver.early.early_bytes_wasted > 0
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert saver.host_pool.num_used_slots == 0


def test_early_saves_hide_the_save_stall_on_the_virtual_clock():
    base = dict(model={"backend": "null"}, cache={"num_blocks": 40})
    stalls = {}
    for policy in ("none", "always"):
        config = small_config(
            **base,
            scheduler={"max_num_seqs": 4, "policy": "priority_score"},
            preemption={"mode": "swap_zstd", **AGGRESSIVE},
            early_save={"policy": policy},
        )
        engine = Engine(config)
        engine.run(_workload())
        stalls[policy] = engine.stats()
    assert stalls["none"]["preemption_stall_save_s"] > 0
    assert stalls["always"]["preemption_stall_save_s"] < 0.5 * stalls["none"]["preemption_stall_save_s"]


def test_rule_policy_picks_the_lowest_scored_slice_used_request():
    running = [make_request(i, 4, 4) for i in range(3)]
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    features = np.zeros((3, len(FEATURE_NAMES)), dtype=np.float32)
    features[:, col["slice_usage"]] = [1.5, 0.2, 1.0]
    features[:, col["score_rank"]] = [1, 0, 2]  # request 1 is the lowest but inside its slice
    features[:, col["free_kv_fraction"]] = 0.5
    assert RulePolicy().select(running, features, 0.0) == []  # nobody waits, memory is fine
    features[:, col["queue_pressure"]] = 1
    assert RulePolicy().select(running, features, 0.0) == [running[0]]


def test_oracle_policy_reads_a_reference_run(tmp_path):
    path = tmp_path / "preemptions.parquet"
    table = {
        "time_s": [1.0, 2.0, 1.5, 0.5],
        "request_id": [7, 7, 8, 9],
        "reason": ["priority", "memory", "reclaim", "priority"],
        "action": ["save", "save", "save", "none"],
    }
    pq.write_table(pa.table(table), path)
    assert {k: v.tolist() for k, v in load_preemption_times(str(path)).items()} == {7: [1.0, 2.0]}
    oracle = OraclePolicy(str(path), horizon_ms=50)
    running = [make_request(i, 4, 4) for i in (7, 8, 9)]
    assert oracle.select(running, None, 0.96) == [running[0]]
    assert oracle.select(running, None, 0.90) == []
    with pytest.raises(ValueError, match="oracle_log.*cannot read"):
        load_preemption_times(str(tmp_path / "missing.parquet"))


def test_bad_early_save_configs_are_clear_errors():
    with pytest.raises(ConfigError, match="needs a preemption.mode that saves KV"):
        small_config(early_save={"policy": "always"})
    with pytest.raises(ValueError, match="needs early_save.checkpoint"):
        EarlySaveConfig(policy="lstm")
    with pytest.raises(ValueError, match="needs early_save.oracle_log"):
        EarlySaveConfig(policy="oracle")
    with pytest.raises(ValueError, match="waste_cap moves the lstm policy's threshold; policy is 'rule'"):
        EarlySaveConfig(policy="rule", waste_cap=0.3)
    with pytest.raises(ValueError, match="waste_cap"):
        EarlySaveConfig(policy="lstm", checkpoint="x.ckpt", waste_cap=1.5)


def test_waste_cap_moves_the_threshold_toward_the_cap_and_no_further_than_its_bound():
    cap = WasteCap(threshold=0.9, cap=0.3, gain=0.5)
    assert cap.threshold == pytest.approx(0.9) and cap.recent_waste_share is None
    cap.update(0, 0)  # nothing resolved: nothing moves
    assert cap.threshold == pytest.approx(0.9)
    cap.update(100, 900)  # 90% wasted: stricter
    assert cap.recent_waste_share == pytest.approx(0.9) and cap.threshold > 0.9
    raised = cap.threshold
    cap.update(100, 900)  # the same totals again: no new outcome, no move
    assert cap.threshold == raised
    for step in range(1, 40):  # then only claims: the share falls under the cap, it relaxes
        cap.update(100 + 1000 * step, 900)
    assert cap.recent_waste_share < 0.3 and cap.threshold < raised
    # The share is of recent outcomes: old waste is forgotten by MEMORY per resolved step.
    assert cap.recent_waste_share == pytest.approx(
        900
        * WasteCap.MEMORY**39
        / (
            900 * WasteCap.MEMORY**39
            + sum(1000 * WasteCap.MEMORY**k for k in range(39))
            + 100 * WasteCap.MEMORY**39
        )
    )
    bounded = WasteCap(threshold=0.5, cap=0.1, gain=100.0)
    for step in range(1, 10):
        bounded.update(0, 1000 * step)  # all wasted, a huge gain: held within MAX_SHIFT logits
    assert bounded.threshold == pytest.approx(1 / (1 + np.exp(-WasteCap.MAX_SHIFT)))


def test_wall_clock_early_saves_on_their_own_worker_change_no_output():
    _, unpreempted_requests = _run("recompute", policy="vllm_fcfs")
    config = small_config(
        clock={"kind": "wall"},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": "swap_zstd", **AGGRESSIVE},
        early_save={"policy": "always"},
    )
    engine = Engine(config)
    requests = _workload()
    engine.run(requests)
    engine.close()
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == _digests(unpreempted_requests)
    saver = engine.saver
    assert saver.early.num_early_saves > 0 and saver.early_thread_s > 0
    assert saver.host_pool.num_used_slots == 0 and saver.early.speculative_bytes == 0


@pytest.mark.parametrize("mode", ["swap", "pause"])
def test_aborting_a_request_frees_its_early_copies(mode):
    engine = Engine(small_config(preemption={"mode": mode}, early_save={"policy": "always"}))
    saver = engine.saver
    request = make_request(0, 21, 60)
    engine.add_request(request)
    for _ in range(5):
        engine.step()
    assert saver.host_pool.num_used_slots > 0 and saver.early.speculative_bytes > 0
    engine.abort_request(request, "client gone")
    assert saver.host_pool.num_used_slots == 0 and saver.early.speculative_bytes == 0
    assert not saver.early._segments and saver.early.early_bytes_wasted == saver.early.early_bytes_raw


def test_a_victims_blocks_wait_only_for_its_own_copies():
    # A's KV was fully copied early; B's big speculative copy is still on the link when A
    # is preempted: the step that reuses A's blocks must not wait for B's copy.
    def run(policy):
        config = small_config(
            model={"backend": "null"},
            cache={"block_size": 4, "num_blocks": 16 + 16 + 1001},
            scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 8192, "policy": "vllm_priority"},
            preemption={"mode": "swap", "host_mem": "8GB", "slot_size": "1GB"},
            early_save={"policy": policy},
        )
        engine = Engine(config)
        x, a = make_request(0, 63, 50, sla_level=1), make_request(1, 63, 50, sla_level=0)
        engine.add_request(x)
        engine.add_request(a)
        engine.step()
        engine.add_request(make_request(2, 4001, 50, sla_level=1))
        engine.step()
        output = engine.step()  # x needs a 17th block: a is the memory victim
        (record,) = [r for r in output.scheduled.records if r.request_id == 1]
        return record, output.stall_s

    plain, plain_stall = run("none")
    early, early_stall = run("always")
    assert early.bytes_raw == 0 and early.bytes_early == plain.bytes_raw  # all copied ahead
    assert early_stall < plain_stall


def test_refusals_count_picks_with_new_blocks_the_saver_turned_down():
    # One request alone, picked every step: a step with no new full block is "nothing
    # new", never a refusal; under a 2-block budget, four requests are refused.
    alone = Engine(small_config(preemption={"mode": "swap"}, early_save={"policy": "always"}))
    request = make_request(0, 30, 40)
    alone.add_request(request)
    while not request.state.is_final:
        alone.step()
    assert alone.early_saver.num_selected > alone.saver.early.num_early_saves > 0
    assert alone.saver.early.num_refused == 0
    tight = Engine(
        small_config(preemption={"mode": "swap"}, early_save={"policy": "always", "host_budget": 20000})
    )
    requests = [make_request(i, 30, 40) for i in range(4)]
    for r in requests:
        tight.add_request(r)
    while any(not r.state.is_final for r in requests):
        tight.step()
    assert tight.saver.early.num_refused > 0
    assert "early_save_refused" not in tight.stats()  # the golden runs' summaries stay as they are
