"""Priority preemption with KV save/restore: lossless modes keep outputs, failures end in
defined states, limits hold. Engine-level (the scheduler and saver together)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preempt.core.limits import RATE_WINDOW_S
from preempt.core.request import RequestState
from preempt.engine.engine import Engine
from preempt.engine.priority import time_slice_s
from preempt.engine.view import StepOutput
from preempt.obs.results import output_digest
from tests.conftest import make_request, small_config

# Priority preemption everywhere: tiny slices, no rate cap, many preemptions allowed.
AGGRESSIVE = {
    "min_time_slice_ms": 0.0,
    "time_slices": {"long_ms": 5.0, "medium_ms": 5.0, "short_ms": 5.0, "static_ms": 5.0},
    "max_preemption_per_min": None,
    "max_consecutive_preemptions": 100,
}


def _workload(seed: int = 0):
    # Eight long level-0 requests fill the batch at t=0; then a VIP arrives every 15 ms,
    # finds no free seat and outranks (score +0.8) a running one that used its slice.
    background = [make_request(i, 8 + (i * 13) % 33, 30 + i, seed=seed) for i in range(8)]
    vips = [
        make_request(8 + k, 5 + (k * 7) % 30, 4 + k % 7, arrival_s=0.02 + 0.015 * k, sla_level=1, seed=seed)
        for k in range(16)
    ]
    return background + vips


def _run(mode: str, *, num_blocks: int = 256, policy: str = "priority_score", early=None, **preemption):
    config = small_config(
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": 4, "policy": policy},
        preemption={"mode": mode, **AGGRESSIVE, **preemption},
        early_save=early or {},
    )
    engine = Engine(config)
    requests = _workload()
    engine.run(requests)
    engine.close()
    return engine, requests


def _digests(requests):
    return [output_digest(r.output_token_ids) for r in requests]


@pytest.fixture(scope="module")
def unpreempted():
    # Preemption disabled: FCFS never preempts for priority, and the pool never runs out.
    engine, requests = _run("recompute", policy="vllm_fcfs")
    assert engine.scheduler.num_preemptions == 0
    return _digests(requests)


LOSSLESS_MODES = [
    ("recompute", {}),
    ("swap", {}),
    ("swap_zstd", {}),
    ("pause", {}),
    ("swap_mixed", {"codecs": {"mixed": {"plan": "fp16"}}}),  # all heads kept: lossless, no warm-up needed
]


@pytest.mark.parametrize(("mode", "options"), LOSSLESS_MODES, ids=[m for m, _ in LOSSLESS_MODES])
def test_lossless_modes_change_no_output(mode, options, unpreempted):
    engine, requests = _run(mode, **options)
    # several preemptions (9-12 as the clock is refitted), each saved and restored or resumed
    assert engine.scheduler.num_preemptions >= 5, "the workload must actually preempt"
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == unpreempted
    if mode.startswith("swap"):
        saves = [r for r in engine.scheduler.records if r.action == "save"]
        assert saves and all(r.restored for r in saves)
        assert engine.saver.bytes_raw > 0
    if mode == "pause":
        # Zero copy: with blocks to spare, paused requests resume by re-pointing their
        # block table; no KV is ever saved.
        assert any(r.action == "pause" for r in engine.scheduler.records)
        assert not any(r.reason == "reclaim" for r in engine.scheduler.records)
        assert engine.saver.bytes_raw == 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    if engine.saver is not None:
        assert engine.saver.host_pool.num_used_slots == 0
        engine.saver.host_pool.check()


def test_lossless_under_memory_pressure_with_reclaim(unpreempted):
    # 30 blocks x 4 tokens: pause must reclaim (save) paused requests and swap must
    # save under forced (memory) preemptions too; outputs still unchanged.
    for mode in ("pause", "swap_zstd"):
        engine, requests = _run(mode, num_blocks=30)
        reasons = {r.reason for r in engine.scheduler.records}
        assert "memory" in reasons or "reclaim" in reasons, reasons
        assert _digests(requests) == unpreempted


def test_save_then_restore_gives_bit_identical_kv():
    config = small_config(preemption={"mode": "swap_zstd"})
    engine = Engine(config)
    request = make_request(0, 37, 50)
    engine.add_request(request)
    for _ in range(5):
        engine.step()
    saver, kv_cache, pool = engine.saver, engine.runner.kv_cache, engine.block_pool
    num_tokens = request.num_computed_tokens
    bs = engine.block_size

    def logical_kv():  # (L, 2, T, H, D): the request's tokens, in order
        blocks = kv_cache.read_blocks(request.block_ids[: -(-num_tokens // bs)])
        return blocks.flatten(2, 3)[:, :, :num_tokens]

    before = logical_kv().clone()
    assert num_tokens % bs != 0  # a partial last block is part of the test
    saved = saver.save(request, "zstd", 0.0)
    assert saved.failure is None
    assert saved.bytes_raw == -(-num_tokens // bs) * bs * before[:, :, :1].numel() * before.element_size()
    assert saved.bytes_stored.result() > 0
    old_blocks = request.block_ids
    kv_cache.kv[:, :, old_blocks] = float("nan")  # the old blocks get overwritten by others
    pool.free(old_blocks)
    request.block_ids = pool.allocate(len(old_blocks))
    restored = saver.restore(request, 0.0)
    assert restored.ok and restored.warmup_tokens == 0 and restored.restore_s > 0  # modelled copy-in
    assert torch.equal(before, logical_kv())
    assert saver.host_pool.num_used_slots == 0


def _swap_engine(**preemption):
    config = small_config(
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": "swap", **AGGRESSIVE, **preemption},
    )
    return Engine(config)


def test_full_host_pool_marks_preemption_failed_and_backs_off(unpreempted):
    # One 64 KB slot (a request's float64 KV is 2 KB/token): the first save fits, then
    # the pool is full while that request stays preempted.
    engine = _swap_engine(host_mem="64KB", slot_size="64KB")
    requests = _workload()
    admissions_blocked = []

    def watch(output: StepOutput) -> None:
        if engine.scheduler.backoff_until_s > engine.clock.now():
            admissions_blocked.append(engine.clock.now())

    engine.run(requests, on_step=watch)
    failures = [r for r in engine.scheduler.records if r.failure == "pool_full"]
    assert failures and all(r.action == "none" for r in failures)  # kept running, KV intact
    failed = [r for r in requests if r.preemption_failed]
    assert failed and engine.scheduler.num_preemption_failed == len(failed)
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert admissions_blocked, "backoff must hold new admissions for a while"
    assert _digests(requests) == unpreempted
    assert (
        engine.saver.host_pool.num_used_slots == 0
        and engine.block_pool.num_free == engine.block_pool.num_blocks
    )


def test_request_larger_than_a_slot_takes_the_fallback():
    engine = _swap_engine(host_mem="4MB", slot_size="4KB")  # no request's KV fits 4 KB
    requests = _workload()
    engine.run(requests)
    failures = {r.failure for r in engine.scheduler.records if r.failure}
    assert failures == {"blob_too_large"}
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert engine.saver.bytes_raw == 0


def test_consecutive_preemption_limit():
    engine = _swap_engine(max_consecutive_preemptions=1)
    requests = _workload()
    engine.run(requests)
    limited = [r for r in engine.scheduler.records if r.failure == "consecutive_limit"]
    assert limited, "some request must hit the limit"
    assert max(r.num_preemptions for r in requests) <= 1
    by_id = {r.request_id: r for r in requests}
    assert all(by_id[r.request_id].preemption_failed for r in limited)
    assert all(r.state is RequestState.FINISHED for r in requests)


@pytest.mark.parametrize(
    "preemption", [{}, {"mode": "swap_mixed", "codecs": {"mixed": {"plan": "fp16"}}}], ids=["raw", "mixed"]
)
def test_corrupted_blob_falls_back_to_recompute(preemption, unpreempted):
    engine = _swap_engine(**preemption)
    saver = engine.saver
    original_save = saver.save

    def corrupting_save(request, codec, now):
        result = original_save(request, codec, now)
        if result.failure is None:
            handle = saver._saved[request].segments[-1].handle
            saver.host_pool.load_tensor(handle)[-1] ^= 0xFF  # flip the payload's last byte
        return result

    saver.save = corrupting_save
    requests = _workload()
    engine.run(requests)
    assert engine.scheduler.num_restore_fallbacks > 0
    assert engine.scheduler.num_restore_fallbacks == sum(
        r.restored is False for r in engine.scheduler.records
    )
    assert _digests(requests) == unpreempted
    assert saver.host_pool.num_used_slots == 0


def test_lossy_mixed_mode_ends_every_request_and_masks_dropped_prefixes():
    engine, requests = _run(
        "swap_mixed", codecs={"mixed": {"plan": "random", "fp8_share": 0.5, "drop_share": 0.25}}
    )
    plan = engine.saver.plan
    assert plan.num_drop == 1 and plan.num_fp8 == 2  # 2 layers x 2 KV heads
    saves = [r for r in engine.scheduler.records if r.action == "save"]
    assert len(saves) >= 10 and all(r.restored and r.codec == "mixed" for r in saves)
    assert all(r.warmup_tokens == 2 for r in saves)
    assert all(r.bytes_stored < r.bytes_raw for r in saves)
    assert all(r.state is RequestState.FINISHED for r in requests)
    restored_ids = {r.request_id for r in saves}
    dropped = plan.dropped_mask().numpy()
    for request in requests:
        if request.request_id in restored_ids:
            masked = request.kv_masked_until
            assert (masked[dropped] > 0).all() and (masked[~dropped] == 0).all()
            # the last restore's tokens minus the warm-up, which is recomputed and visible
            last = max(r.num_tokens for r in saves if r.request_id == request.request_id)
            assert masked.max() <= last - 2
        else:
            assert request.kv_masked_until is None
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert engine.saver.host_pool.num_used_slots == 0
    engine.saver.host_pool.check()


def test_mixed_restore_dequantizes_into_new_blocks_and_asks_for_warmup():
    from preempt.kernels.plan import HeadClass, HeadPlan

    engine = Engine(small_config(preemption={"mode": "swap_mixed", "codecs": {"mixed": {"plan": "fp8"}}}))
    saver = engine.saver
    plan = HeadPlan.from_codes([[HeadClass.FP16, HeadClass.FP8], [HeadClass.DROP, HeadClass.FP16]])
    saver.blobs.codecs["mixed"].plan = plan
    request = make_request(0, 37, 50)
    engine.add_request(request)
    for _ in range(5):
        engine.step()
    kv_cache, pool, bs = engine.runner.kv_cache, engine.block_pool, engine.block_size
    num_tokens = request.num_computed_tokens

    def logical_kv():  # (L, 2, T, H, D)
        return kv_cache.read_blocks(request.block_ids[: -(-num_tokens // bs)]).flatten(2, 3)[
            :, :, :num_tokens
        ]

    before = logical_kv().clone()
    saved = saver.save(request, "mixed", 0.0)
    assert saved.failure is None
    itemsize = before.element_size()
    per_token_kv = 2 * 32  # K and V, head_dim 32: FP16 heads keep the cache's float64 bytes
    stored = saved.bytes_stored.result()
    assert stored < 2 * num_tokens * per_token_kv * itemsize + 2 * num_tokens * per_token_kv
    old_blocks = request.block_ids
    kv_cache.kv[:, :, old_blocks] = float("nan")
    pool.free(old_blocks)
    request.block_ids = pool.allocate(len(old_blocks))
    restored = saver.restore(request, 0.0)
    assert restored.ok
    after = logical_kv()
    assert torch.equal(after[0, :, :, 0], before[0, :, :, 0]) and torch.equal(
        after[1, :, :, 1], before[1, :, :, 1]
    )
    assert (after[1, :, :, 0] == 0).all()  # dropped: zeros, and masked from now on
    # FP8: relative error of E4M3 (3 mantissa bits) is at most 2^-4 of the value, plus half
    # the smallest subnormal step times the scale for values near zero.
    fp8_head = before[0, :, :, 1]
    scale = fp8_head.abs().amax(dim=(1, 2), keepdim=True) / 448
    bound = fp8_head.abs() * 2**-4 + scale * 2**-10
    assert ((after[0, :, :, 1] - fp8_head).abs() <= bound).all()
    assert request.kv_masked_until.tolist() == [[0, 0], [num_tokens - 2, 0]]
    assert restored.warmup_tokens == 2
    assert saver.host_pool.num_used_slots == 0


def test_mixed_mode_on_the_null_backend_stores_the_plans_share():
    config = small_config(
        model={"backend": "null"},
        preemption={"mode": "swap_mixed", "codecs": {"mixed": {"plan": "random", "drop_share": 0.1}}},
    )
    engine = Engine(config)
    plan = engine.saver.plan
    target = engine.cost_model.target
    assert (plan.num_layers, plan.num_kv_heads) == (target.num_layers, target.num_kv_heads)
    mixed = engine.saver.blobs.codecs["mixed"]
    assert mixed.size_ratio == pytest.approx(0.65, abs=0.01)  # design §9: 35% smaller
    request = make_request(0, 100, 5)
    request.num_computed_tokens = 100
    saved = engine.saver.save(request, "mixed", 0.0)
    assert saved.failure is None
    assert saved.bytes_stored.result() == int(100 * target.kv_bytes_per_token * mixed.size_ratio)


def test_aborting_a_saved_request_frees_its_slot():
    engine = _swap_engine()
    requests = _workload()
    pending = list(requests)
    for _ in range(1000):  # step by hand until some request's KV sits in the host pool
        if any(r.kv_location == "host" for r in requests):
            break
        while pending and pending[0].arrival_s <= engine.clock.now():
            engine.add_request(pending.pop(0))
        engine.step()
    saved = next(r for r in requests if r.kv_location == "host")
    engine.abort_request(saved, "client_disconnected")
    assert saved.state is RequestState.ABORTED
    engine.run(pending)
    assert (
        engine.saver.host_pool.num_used_slots == 0
        and engine.block_pool.num_free == engine.block_pool.num_blocks
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 200), st.integers(1, 60), st.integers(0, 2)), min_size=2, max_size=40
    ),
    limit=st.integers(1, 5),
    strategy=st.sampled_from(["static", "dynamic"]),
    policy=st.sampled_from(["priority_score", "fastserve_mlfq"]),
    mode=st.sampled_from(["recompute", "swap", "pause"]),
    gap_s=st.floats(0.0005, 0.05),
)
def test_rate_limit_and_time_slices_hold(lengths, limit, strategy, policy, mode, gap_s):
    config = small_config(
        model={"backend": "null"},
        cache={"num_blocks": 4096},
        scheduler={"max_num_seqs": 3, "policy": policy},
        preemption={
            "mode": mode,
            "time_slice_strategy": strategy,
            "max_preemption_per_min": limit,
            "priority_weights": {"age": 1.2, "sla": 5.0, "tokens": 0.5},
        },
    )
    engine = Engine(config)
    requests = [
        make_request(i, p, o, arrival_s=gap_s * i, sla_level=s) for i, (p, o, s) in enumerate(lengths)
    ]
    engine.run(requests)
    records = [r for r in engine.scheduler.records if r.reason == "priority" and r.action != "none"]
    times = [
        r.time_s
        for r in engine.scheduler.records
        if r.reason in ("priority", "memory") and r.action != "none"
    ]
    for record in records:
        earlier = [t for t in times if record.time_s - RATE_WINDOW_S < t < record.time_s]
        assert len(earlier) < limit
        if policy == "priority_score":
            assert record.slice_used_s >= record.slice_s > 0
    assert all(r.state.is_final for r in requests)
    assert engine.block_pool.num_free == 4096


def test_dynamic_slices_follow_length_classes():
    from preempt.core.config import PreemptionConfig

    config = PreemptionConfig(min_time_slice_ms=15)
    short, medium, long = make_request(0, 50, 1), make_request(1, 300, 1), make_request(2, 600, 1)
    assert [time_slice_s(r, config) for r in (short, medium, long)] == [0.015, 0.020, 0.050]
    static = PreemptionConfig(time_slice_strategy="static")
    assert {time_slice_s(r, static) for r in (short, medium, long)} == {0.020}
