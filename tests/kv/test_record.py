"""`PreemptionRecord.is_preemption`: the one definition of "this record took a running
request out of the batch", checked against the scheduler's own count on runs that also
log failed attempts (kept running) and reclaims (deferred saves of paused requests)."""

from __future__ import annotations

import pytest

from preempt.engine.engine import Engine
from preempt.kv.record import PreemptionRecord, is_preemption
from tests.conftest import small_config
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
