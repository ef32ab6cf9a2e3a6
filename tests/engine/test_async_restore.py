"""Asynchronous restores (`preemption.async_restore`): a restored request waits READY out of
the batch until its copy-in ends, never runs before, changes no lossless output, and the
batch no longer stalls on it; the books (blocks, seats, stall and wait) stay exact."""

from __future__ import annotations

import pytest

from preempt.core.config import ConfigError
from preempt.core.request import RequestState
from preempt.engine.engine import Engine
from preempt.engine.scheduler import Scheduler
from tests.conftest import small_config
from tests.early.test_prefetch import check_accounting
from tests.kv.test_preemption import AGGRESSIVE, _digests, _run, _workload


def _config(mode="swap", num_blocks=256, backend="tiny", async_restore=True, early=None, **preemption):
    return small_config(
        model={"backend": backend},
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": mode, **AGGRESSIVE, "async_restore": async_restore, **preemption},
        early_save=early or {},
    )


class ReadyWatch:
    """Records when each async-restored request may join (its copy-in end, from the
    scheduler at admission) and checks after every step that none computed before."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.engine = engine
        self.ready_s: dict[int, float] = {}  # id(request) -> copy-in end, while READY
        self.num_parked = 0
        self.num_joined = 0
        original = Scheduler._restore_in_background
        watch = self

        def recording(scheduler, request, now):
            parked = original(scheduler, request, now)
            if parked:
                ready_s, admitted_s = scheduler.restores.ready_at(request)
                assert admitted_s == now and ready_s > now
                assert request.state is RequestState.READY and request.block_ids
                watch.ready_s[id(request)] = ready_s
                watch.num_parked += 1
            return parked

        monkeypatch.setattr(Scheduler, "_restore_in_background", recording)

    def __call__(self, output) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        started_s = engine.clock.now() - output.step_s  # this step's compute began here
        restoring = {id(r) for r in scheduler.restoring}
        for chunk in output.scheduled.chunks:
            request = chunk.request
            assert id(request) not in restoring, "a READY request was in the batch"
            ready_s = self.ready_s.pop(id(request), None)
            if ready_s is not None:  # its first step after the copy-in
                assert started_s >= ready_s - 1e-12, "ran before its copy-in ended"
                self.num_joined += 1
        for request in scheduler.restoring:
            assert request.state is RequestState.READY
            assert id(request) in self.ready_s
        assert scheduler.num_seated <= scheduler.config.max_num_seqs
        check_accounting(engine)


LOSSLESS = [("swap", 256), ("swap_zstd", 256), ("pause", 30)]  # pause: 30 blocks, so it reclaims


@pytest.mark.parametrize(("mode", "num_blocks"), LOSSLESS, ids=[m for m, _ in LOSSLESS])
def test_async_restores_change_no_lossless_output_and_never_run_early(mode, num_blocks, monkeypatch):
    _, unpreempted = _run("recompute", policy="vllm_fcfs")
    engine = Engine(_config(mode, num_blocks=num_blocks))
    watch = ReadyWatch(engine, monkeypatch)
    requests = _workload()
    engine.run(requests, on_step=watch)
    engine.close()
    assert watch.num_parked > 0, "the workload must restore asynchronously"
    assert watch.num_joined == watch.num_parked and not watch.ready_s
    assert engine.scheduler.restores.num_started == watch.num_parked
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert _digests(requests) == _digests(unpreempted)
    saves = [r for r in engine.scheduler.records if r.action == "save"]
    assert saves and all(r.restored for r in saves)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert engine.saver.host_pool.num_used_slots == 0


def test_the_batch_does_not_wait_for_async_restores_and_the_wait_is_booked():
    """Sync: the batch waits for every restore. Async: the saver's restore timeline that
    compute stalls on never moves, the request-side wait is booked instead, and the
    per-step stalls add up to the engine's total."""
    stats = {}
    for async_restore in (False, True):
        engine = Engine(_config("swap_zstd", backend="null", async_restore=async_restore))
        steps = []
        engine.run(_workload(), on_step=lambda out, steps=steps: steps.append(out.stall_s))
        stats[async_restore] = engine.stats()
        assert sum(steps) == pytest.approx(engine.stall_s, abs=1e-12)
        if async_restore:
            assert engine.saver.restore_end_s == 0.0  # no restore that compute waits for
    sync, asyn = stats[False], stats[True]
    assert sync["preemption_stall_restore_s"] > 0
    assert asyn["preemption_stall_restore_s"] < sync["preemption_stall_restore_s"]
    assert asyn["num_async_restores"] > 0 and asyn["preemption_restore_wait_s"] > 0
    assert "num_async_restores" not in sync  # switch off: the summary keys are unchanged


def test_an_idle_batch_waits_for_the_restore_and_counts_it_as_stall():
    """Nothing else to run: the engine waits for the READY request's copy-in (a restore
    stall), then runs it, in the same step."""
    from tests.conftest import make_request

    engine = Engine(_config("swap", backend="null"))
    request = make_request(0, 64, 8)
    engine.add_request(request)
    engine.step()  # prefill
    scheduler = engine.scheduler
    scheduler._preempt(request, "priority", forced=False)  # saved to the host
    assert request.kv_location == "host"
    now = engine.clock.now()
    output = engine.step()
    assert [c.request for c in output.scheduled.chunks] == [request]
    assert output.stall_s > 0 and engine.stall_restore_s == pytest.approx(output.stall_s)
    assert engine.clock.now() - output.step_s == pytest.approx(now + output.stall_s)
    assert scheduler.restores.wait_s == pytest.approx(output.stall_s)
    assert request.state is RequestState.RUNNING and not scheduler.restoring


def test_lossy_async_restores_recompute_their_warmup(monkeypatch):
    engine = Engine(
        _config("swap_mixed", codecs={"mixed": {"plan": "random", "fp8_share": 0.5, "drop_share": 0.25}})
    )
    watch = ReadyWatch(engine, monkeypatch)
    computed_at_park = {}
    original = Scheduler._restore_in_background

    def parked_state(scheduler, request, now):
        parked = original(scheduler, request, now)
        if parked:
            computed_at_park[id(request)] = (request.num_computed_tokens, scheduler.records[-1])
        return parked

    records_of = {}
    monkeypatch.setattr(Scheduler, "_restore_in_background", parked_state)
    requests = _workload()
    engine.run(requests, on_step=watch)
    for record in engine.scheduler.records:
        records_of.setdefault(record.request_id, []).append(record)
    saves = [r for r in engine.scheduler.records if r.action == "save"]
    assert saves and all(r.restored and r.warmup_tokens == 2 for r in saves)
    assert watch.num_parked > 0
    # Parked with its KV minus the warm-up computed: the warm-up is recomputed on joining.
    by_id = {id(r): r for r in requests}
    for key, (num_computed, _) in computed_at_park.items():
        saved = [r for r in records_of[by_id[key].request_id] if r.action == "save"]
        assert num_computed in {r.num_tokens - r.warmup_tokens for r in saved}
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_corrupt_blob_falls_back_to_recompute_with_async_restores(monkeypatch):
    _, unpreempted = _run("recompute", policy="vllm_fcfs")
    engine = Engine(_config("swap"))
    watch = ReadyWatch(engine, monkeypatch)
    saver = engine.saver
    original_save = saver.save
    corrupted = []

    def corrupting_save(request, codec, now):
        result = original_save(request, codec, now)
        if result.failure is None and len(corrupted) % 2 == 0:  # every other save
            handle = saver._saved[request].segments[-1].handle
            saver.host_pool.load_tensor(handle)[-1] ^= 0xFF
        corrupted.append(request)
        return result

    saver.save = corrupting_save
    requests = _workload()
    engine.run(requests, on_step=watch)
    scheduler = engine.scheduler
    assert scheduler.num_restore_fallbacks > 0 and watch.num_parked > 0
    assert scheduler.num_restore_fallbacks == sum(r.restored is False for r in scheduler.records)
    assert _digests(requests) == _digests(unpreempted)
    assert saver.host_pool.num_used_slots == 0


def test_aborting_a_ready_request_frees_its_blocks_and_seat(monkeypatch):
    engine = Engine(_config("swap_zstd", backend="null"))
    aborted = []

    def on_step(output):
        scheduler = engine.scheduler
        if scheduler.restoring and len(aborted) < 3:
            request = scheduler.restoring[0]
            engine.abort_request(request, "test")
            aborted.append(request)
            assert request.state is RequestState.ABORTED and not request.block_ids
        check_accounting(engine)

    requests = _workload()
    engine.run(requests, on_step=on_step)
    assert aborted, "the workload must leave a request READY after a step"
    assert all(r.state.is_final for r in requests)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert engine.saver.host_pool.num_used_slots == 0


def test_async_restore_is_refused_on_the_wall_clock_and_for_sglang():
    with pytest.raises(ConfigError, match="async_restore needs clock.kind 'virtual'"):
        small_config(clock={"kind": "wall"}, preemption={"mode": "swap", "async_restore": True})
    config = small_config(
        scheduler={"policy": "sglang_priority"}, preemption={"mode": "swap", "async_restore": True}
    )
    with pytest.raises(ConfigError, match="async_restore"):
        Engine(config)
