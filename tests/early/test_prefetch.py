"""Restore prefetch: lossless outputs never change, every prefetched byte ends used or
wasted (exact after every step), blocks are conserved, and prefetch hides restores."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preempt.core.config import ConfigError
from preempt.core.request import RequestState
from preempt.engine.engine import Engine
from tests.conftest import small_config
from tests.kv.test_preemption import AGGRESSIVE, _digests, _run, _workload


def _config(mode="swap_zstd", num_blocks=48, backend="tiny", async_restore=False, **early):
    return small_config(
        model={"backend": backend},
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": mode, **AGGRESSIVE, "async_restore": async_restore},
        early_save={"prefetch": True, **early},
    )


def check_accounting(engine):
    """The invariants after a step: bytes used + wasted + held == prefetched, for the
    copy-in and the decode ahead; blocks held by prefetch are exactly the prefetched
    (waiting, host-located) requests' blocks; every block is free or someone's."""
    saver, scheduler, pool = engine.saver, engine.scheduler, engine.block_pool
    ahead = saver.ahead
    assert ahead.prefetch_bytes == (
        ahead.prefetch_bytes_used + ahead.prefetch_bytes_wasted + ahead.prefetch_bytes_held
    )
    assert ahead.predecode_bytes == (
        ahead.predecode_bytes_used + ahead.predecode_bytes_wasted + ahead.predecode_bytes_held
    )
    waiting = scheduler.waiting_requests()
    # READY requests (async restores) hold blocks that cover their computed KV, and a seat.
    for request in scheduler.restoring:
        assert request.state is RequestState.READY and request.kv_location is None
        assert len(request.block_ids) * engine.block_size >= request.num_computed_tokens
        assert request not in scheduler.running and request not in waiting
    assert len(scheduler.running) + len(scheduler.restoring) <= scheduler.config.max_num_seqs
    owners = scheduler.running + waiting + scheduler.restoring
    for request in saver.prefetched_requests:
        assert request in waiting and request.kv_location == "host"
        assert request.block_ids == saver.ahead.prefetched[request].block_ids
    for request in waiting:
        if request.block_ids:  # only a paused or a prefetched waiting request holds blocks
            assert request in scheduler.paused or saver.is_prefetched(request)
    held = [b for r in owners for b in r.block_ids]
    assert len(held) == len(set(held)), "a block held twice"
    assert pool.num_free + len(held) == pool.num_blocks


@pytest.mark.parametrize("mode", ["swap", "swap_zstd", "swap_mixed"])
def test_prefetch_changes_no_lossless_output(mode):
    _, unpreempted_requests = _run("recompute", policy="vllm_fcfs")
    extra = {"codecs": {"mixed": {"plan": "fp16"}}} if mode == "swap_mixed" else {}
    config = _config(mode)
    config = config.model_copy(update={"preemption": config.preemption.model_copy(update=extra)})
    engine = Engine(config)
    requests = _workload()
    engine.run(requests, on_step=lambda _: check_accounting(engine))
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == _digests(unpreempted_requests)
    saver = engine.saver
    assert saver.ahead.num_prefetch_hits + saver.ahead.num_prefetch_hits_late > 0, (
        "the workload must prefetch"
    )
    assert saver.ahead.prefetch_bytes == saver.ahead.prefetch_bytes_used + saver.ahead.prefetch_bytes_wasted
    assert saver.host_pool.num_used_slots == 0
    saver.host_pool.check()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(24, 80),
    depth=st.integers(1, 6),
    share=st.sampled_from([0.1, 0.3, 1.0]),
    host_budget=st.sampled_from([1, 200_000, 10**9]),
    seed=st.integers(0, 3),
    abort_every=st.sampled_from([0, 7]),
    async_restore=st.booleans(),
)
def test_prefetch_accounting_is_exact_after_every_step(
    num_blocks, depth, share, host_budget, seed, abort_every, async_restore
):
    config = _config(
        "swap_zstd",
        num_blocks=num_blocks,
        backend="null",
        async_restore=async_restore,
        prefetch_depth=depth,
        prefetch_block_share=share,
        prefetch_host_budget=host_budget,
    )
    engine = Engine(config)
    requests = _workload(seed)
    steps = []

    def on_step(output):
        steps.append(1)
        if abort_every and len(steps) % abort_every == 0:
            waiting = engine.scheduler.waiting_requests()
            prefetched = [r for r in waiting if engine.saver.is_prefetched(r)]
            if prefetched:  # an aborted prefetched request: its copy-in is wasted
                engine.abort_request(prefetched[0], "test")
            if engine.scheduler.restoring:  # an aborted READY request (async restore)
                engine.abort_request(engine.scheduler.restoring[-1], "test")
        check_accounting(engine)

    engine.run(requests, on_step=on_step)
    assert all(r.state.is_final for r in requests)
    saver = engine.saver
    assert saver.ahead.prefetch_bytes_held == 0 and saver.ahead.predecode_bytes_held == 0
    assert saver.ahead.prefetch_bytes == saver.ahead.prefetch_bytes_used + saver.ahead.prefetch_bytes_wasted
    assert saver.host_pool.num_used_slots == 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_prefetched_blocks_never_keep_the_head_waiting():
    """Regression (found by the property test above): prefetches held the blocks of 4
    waiting requests while 2 new requests of higher rank, which needed them, came first;
    with nothing running nobody freed them and the run stopped ("no progress"). The
    scheduler now cancels prefetches behind the head it cannot otherwise admit."""
    config = _config(
        "swap_zstd",
        num_blocks=34,
        backend="null",
        prefetch_depth=6,
        prefetch_block_share=1.0,
        prefetch_host_budget=10**9,
    )
    engine = Engine(config)
    requests = _workload(3)
    engine.run(requests, on_step=lambda _: check_accounting(engine))
    assert all(r.state is RequestState.FINISHED for r in requests)
    saver = engine.saver
    assert saver.ahead.prefetch_bytes_wasted > 0, "the case must cancel a prefetch at admission"
    assert saver.ahead.prefetch_bytes == saver.ahead.prefetch_bytes_used + saver.ahead.prefetch_bytes_wasted
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_prefetch_hides_restore_stall_on_the_virtual_clock():
    stalls = {}
    for prefetch in (False, True):
        config = small_config(
            model={"backend": "null"},
            cache={"num_blocks": 64},
            scheduler={"max_num_seqs": 4, "policy": "priority_score"},
            # a slow host decode, so that restores cost something to hide
            preemption={"mode": "swap_zstd", **AGGRESSIVE},
            clock={"codecs": {"zstd": {"decode_mb_s": 50.0}}},
            early_save={"prefetch": prefetch},
        )
        engine = Engine(config)
        engine.run(_workload())
        stalls[prefetch] = engine.stall_restore_s
        if prefetch:
            assert engine.saver.ahead.num_prefetch_hits + engine.saver.ahead.num_prefetch_hits_late > 0
    assert stalls[False] > 0 and stalls[True] < 0.5 * stalls[False]


def test_prefetch_needs_the_virtual_clock_and_a_save_mode():
    with pytest.raises(ConfigError, match="virtual"):
        small_config(clock={"kind": "wall"}, preemption={"mode": "swap"}, early_save={"prefetch": True})
    with pytest.raises(ConfigError, match="recompute"):
        small_config(preemption={"mode": "recompute"}, early_save={"prefetch": True})


@pytest.mark.parametrize("async_restore", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["swap", "swap_zstd"])
def test_prefetch_counts_admitted_copy_ins_and_those_without_lead(mode, async_restore, monkeypatch):
    """`num_prefetch_admitted` = restores that claimed a copy-in done ahead; `..._without_lead`
    = those whose copy-in started in the hook right before the admission (no step between).
    `num_prefetch_hits` = restores whose copy-in (else decode) done ahead had ended by the
    admission, `num_prefetch_hits_late` = those where it was still running."""
    from preempt.kv.saver import Saver

    engine = Engine(_config(mode, backend="null", async_restore=async_restore))
    started, claimed, ended = {}, [], []
    prefetch, restore = Saver.prefetch, Saver.restore

    def counting_prefetch(saver, request, now):
        started[id(request)] = engine.num_steps
        return prefetch(saver, request, now)

    def counting_restore(saver, request, now, **kwargs):
        if saver.is_prefetched(request):
            claimed.append(engine.num_steps == started[id(request)])
            ended.append(saver.ahead.prefetched[request].end_s <= now)
        elif saver.is_predecoded(request):
            ended.append(saver.ahead.predecoded[request].end_s <= now)
        return restore(saver, request, now, **kwargs)

    monkeypatch.setattr(Saver, "prefetch", counting_prefetch)
    monkeypatch.setattr(Saver, "restore", counting_restore)
    engine.run(_workload())
    stats = engine.stats()
    assert stats["num_prefetch_admitted"] == len(claimed) > 0
    assert stats["num_prefetch_admitted_without_lead"] == sum(claimed)
    assert stats["num_prefetch_hits"] == sum(ended) and stats["num_prefetch_hits_late"] == len(ended) - sum(
        ended
    )
    assert ended, "the workload must claim work done ahead"
    if not async_restore:  # here most copy-ins start right before their admission
        assert stats["num_prefetch_hits_late"] > 0
