"""The scheduler's records: `is_preemption`, the one definition of "this record took a
running request out of the batch" (checked against the scheduler's own count on runs
that also log failed attempts and reclaims), and one owner: sizes a worker learns later
reach the record through a future, written by the scheduler alone."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from preempt.core.block_pool import BlockPool
from preempt.core.config import PreemptionConfig, SchedulerConfig
from preempt.engine.engine import Engine
from preempt.engine.policies import get_policy
from preempt.engine.scheduler import Scheduler
from preempt.kv.record import KVMover, PreemptionRecord, RestoreResult, SaveResult, is_preemption
from tests.conftest import make_request, small_config
from tests.engine.test_scheduler import complete
from tests.kv.test_preemption import AGGRESSIVE, _workload


@pytest.mark.parametrize(
    ("mode", "extra", "num_blocks", "kind"),
    [
        ("swap", {"host_mem": "64KB", "slot_size": "64KB"}, 256, "failure"),  # pool full: kept running
        ("pause", {}, 40, "reclaim"),  # paused requests' blocks reclaimed under memory pressure
    ],
)
def test_is_preemption_counts_what_the_scheduler_counts(mode, extra, num_blocks, kind):
    config = small_config(
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": mode, **AGGRESSIVE, **extra},
    )
    engine = Engine(config)
    engine.run(_workload())
    records = engine.scheduler.records
    # The run must hold records that are not preemptions, or the check proves nothing.
    if kind == "failure":
        assert any(r.action == "none" for r in records)
    else:
        assert any(r.reason == "reclaim" for r in records)
    assert sum(r.is_preemption for r in records) == engine.scheduler.num_preemptions > 0


def test_is_preemption_on_rows_and_records_agree():
    cases = [("priority", "save", True), ("priority", "none", False), ("memory", "recompute", True)]
    cases += [("reclaim", "save", False), ("priority", "pause", True)]
    for reason, action, expected in cases:
        record = PreemptionRecord(0.0, 1, reason, action, 8)
        assert record.is_preemption is is_preemption(reason, action) is expected


def test_stored_sizes_come_through_futures_and_only_the_scheduler_writes_them():
    # A mover whose worker has not reported yet: the record keeps 0 until the future is
    # done and the scheduler settles it (at its next schedule), never from the worker.
    class SlowWorkerMover(KVMover):
        def __init__(self):
            self.stored: list[Future] = []

        def save(self, request, codec, now):
            future = Future()
            self.stored.append(future)
            return SaveResult(None, bytes_raw=100, save_s=0.5, bytes_stored=future)

        def restore(self, request, now, *, background=False):
            return RestoreResult(True)

        def discard(self, request):
            pass

    preemption = PreemptionConfig(mode="swap")
    mover = SlowWorkerMover()
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        get_policy("vllm_fcfs", preemption),
        BlockPool(6),
        4,
        preemption,
        mover,
    )
    for i in range(2):
        scheduler.add_request(make_request(i, 8, 30, arrival_s=float(i)))
    for _ in range(12):  # two requests outgrow 6 blocks: the younger is preempted and saved
        complete(scheduler, scheduler.schedule())
        if scheduler.records:
            break
    (record,) = scheduler.records
    assert (record.action, record.bytes_raw, record.save_s, record.bytes_stored) == ("save", 100, 0.5, 0)
    mover.stored[0].set_result(42)  # the worker stores the blob
    assert record.bytes_stored == 0  # nobody but the scheduler writes the record
    scheduler.schedule()
    assert record.bytes_stored == 42


def test_wall_clock_stored_sizes_reach_the_records():
    # The saver's worker encodes after the engine moved on: every save's record still
    # ends with its stored size, and they add up to the saver's own count.
    config = small_config(
        clock={"kind": "wall"},
        scheduler={"max_num_seqs": 4, "policy": "priority_score"},
        preemption={"mode": "swap_zstd", **AGGRESSIVE},
    )
    engine = Engine(config)
    engine.run(_workload())
    engine.close()
    saves = [r for r in engine.scheduler.records if r.bytes_raw]
    assert saves and all(r.bytes_stored > 0 for r in saves)
    assert sum(r.bytes_stored for r in saves) == engine.stats()["kv_saved_bytes_stored"]
