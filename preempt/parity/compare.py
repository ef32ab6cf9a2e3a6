"""Step-by-step comparison of two schedulers' traces, and the totals a user compares.

A trace is a list of steps, each `{"scheduled": {id: [start, num_tokens]}, "preempted":
[id, ...], "finished": [id, ...]}`. Two steps agree when they scheduled the same requests
with the same tokens from the same positions, preempted the same victims in the same
order, and finished the same requests.
"""

from __future__ import annotations

from typing import Any

FIELDS = ("scheduled", "preempted", "finished")


def totals(trace: list[dict]) -> dict[str, int]:
    """Steps, preemptions, scheduled tokens and recomputed tokens (tokens scheduled at
    positions a request had computed before: the cost of recompute preemption)."""
    high_water: dict[str, int] = {}
    recomputed = scheduled_tokens = preemptions = 0
    for step in trace:
        preemptions += len(step["preempted"])
        for req_id, (start, num) in step["scheduled"].items():
            end = start + num
            scheduled_tokens += num
            recomputed += max(0, min(end, high_water.get(req_id, 0)) - start)
            high_water[req_id] = max(high_water.get(req_id, 0), end)
    return {
        "steps": len(trace),
        "preemptions": preemptions,
        "scheduled_tokens": scheduled_tokens,
        "recomputed_tokens": recomputed,
    }


def _same(field: str, a: Any, b: Any) -> bool:
    if field == "finished":
        return sorted(a) == sorted(b)
    return a == b  # scheduled: a dict (batch order is not a decision); preempted: ordered


def compare_traces(
    reference: list[dict], ours: list[dict], names: tuple[str, str] = ("vllm", "preempt")
) -> dict:
    """Agreement of `ours` with `reference`: identical, the first differing step (with
    both sides' values), per-field shares of agreeing steps, and both sides' totals."""
    num_steps = max(len(reference), len(ours))
    agree = dict.fromkeys(FIELDS, 0)
    agree_all = 0
    first = None
    empty = {"scheduled": {}, "preempted": [], "finished": []}
    for index in range(num_steps):
        ref = reference[index] if index < len(reference) else empty
        mine = ours[index] if index < len(ours) else empty
        step_ok = True
        for field in FIELDS:
            if _same(field, ref[field], mine[field]):
                agree[field] += 1
            else:
                step_ok = False
                if first is None:
                    first = {"step": index, "field": field, names[0]: ref[field], names[1]: mine[field]}
        agree_all += step_ok
    ref_name, our_name = names
    return {
        "identical": first is None and len(reference) == len(ours),
        "first_divergence": first,
        "steps_agreeing": agree_all,
        "agreement": {field: agree[field] / num_steps if num_steps else 1.0 for field in FIELDS},
        "totals": {ref_name: totals(reference), our_name: totals(ours)},
    }
