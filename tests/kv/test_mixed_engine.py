"""`swap_mixed` with a KIVI head plan file, end to end in the engine: requests are
preempted, their KV saved through the KIVI classes (3..8-bit codes, the version-2 blob),
restored and finished; a plan that loses nothing changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.core.request import RequestState
from preempt.kernels.plan import HeadClass, HeadPlan
from tests.kv.test_preemption import _digests, _run

# small_config's model: 2 layers x 2 KV heads. Groups of 8 tokens, 2 sink and 4 recent
# tokens, so the workload's 8..70-token requests quantize most of their KV.
KIVI_PLAN = HeadPlan.from_codes(
    np.array([[HeadClass.KIVI4, HeadClass.KIVI_K5V4], [HeadClass.KIVI_K6V4, HeadClass.KIVI_K5V3]]),
    "test: KIVI classes",
    params=(8, 2, 4),
)


@pytest.fixture(scope="module")
def unpreempted():
    engine, requests = _run("recompute", policy="vllm_fcfs")
    assert engine.scheduler.num_preemptions == 0
    return _digests(requests)


def _run_with_plan(tmp_path, plan: HeadPlan):
    path = tmp_path / "plan.json"
    plan.save(path)
    return _run("swap_mixed", codecs={"mixed": {"plan": str(path)}})


def test_kivi_plan_preempts_restores_and_finishes_every_request(tmp_path, unpreempted):
    engine, requests = _run_with_plan(tmp_path, KIVI_PLAN)
    assert engine.saver.plan == HeadPlan.load(tmp_path / "plan.json")
    saves = [r for r in engine.scheduler.records if r.action == "save"]
    assert engine.scheduler.num_preemptions >= 10 and len(saves) >= 10
    assert all(r.codec == "mixed" and r.restored for r in saves)
    assert all(r.warmup_tokens == 2 for r in saves)  # lossy: the newest tokens recomputed
    assert sum(r.bytes_stored for r in saves) < 0.5 * sum(r.bytes_raw for r in saves)
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert all(r.kv_masked_until is None for r in requests)  # nothing dropped: nothing masked
    assert _digests(requests) != unpreempted  # lossy: some restored request's output moved
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert engine.saver.host_pool.num_used_slots == 0
    engine.saver.host_pool.check()


@pytest.mark.parametrize("head_class", [HeadClass.FP16, HeadClass.KIVI4], ids=["fp16", "kivi4_all_kept"])
def test_lossless_version_2_plan_changes_no_output(tmp_path, unpreempted, head_class):
    # fp16 with non-default KIVI parameters: a version-2 file and blob (the formats flag);
    # KIVI with 10k recent tokens keeps every token of these requests bit-exact.
    plan = HeadPlan.from_codes(np.full((2, 2), int(head_class)), "test: lossless", params=(8, 2, 10_000))
    engine, requests = _run_with_plan(tmp_path, plan)
    saves = [r for r in engine.scheduler.records if r.action == "save"]
    assert engine.scheduler.num_preemptions >= 10 and saves and all(r.restored for r in saves)
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == unpreempted
