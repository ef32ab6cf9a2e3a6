"""Decode runs (`Engine.run`'s fast path over plain decode steps) change nothing: every
request, record, counter and the clock come out exactly as stepping one step at a time,
bit for bit, on workloads that preempt, save, restore and finish inside runs."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from preempt.core.block_pool import BlockPool
from preempt.core.config import PreemptionConfig, SchedulerConfig, build_config
from preempt.core.workload import build_workload
from preempt.engine.engine import Engine
from preempt.engine.policies import FastServeMlfqPolicy, SchedulingPolicy, get_policy
from preempt.engine.scheduler import Scheduler
from tests.conftest import make_request, small_config

# Small pools under heavy load: memory preemptions, saves and restores between runs.
_BASE = {
    "seed": 3,
    "model": {"backend": "null", "max_model_len": 16384},
    "cache": {"block_size": 16, "num_blocks": 400},
    "scheduler": {"max_num_seqs": 24, "max_num_batched_tokens": 2048},
    "workload": {"trace": "azure-conv", "duration_s": 40, "rate_scale": 6.0, "sla_mix": {0: 0.7, 1: 0.3}},
    "preemption": {"host_mem": "16GB", "slot_size": "1GB"},
}

CASES = {
    "vllm_fcfs": {"scheduler": {"policy": "vllm_fcfs"}},
    "vllm_fcfs_light": {"cache": {"num_blocks": None}, "workload": {"rate_scale": 1.0, "duration_s": 120}},
    "vllm_fcfs_first_chunk": {"scheduler": {"policy": "vllm_fcfs", "reserve_full_sequence": False}},
    "vllm_priority": {"scheduler": {"policy": "vllm_priority"}},
    "vllm_lcf": {"scheduler": {"policy": "vllm_lcf"}},
    "score_class_uncapped": {
        "scheduler": {"policy": "priority_score_class"},
        "preemption": {"max_preemption_per_min": None},
    },
    "score_swap_zstd_learned": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {"mode": "swap_zstd", "remaining": "learned"},
    },
    "score_pause": {"scheduler": {"policy": "priority_score"}, "preemption": {"mode": "pause"}},
    "score_swap_async_oracle": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {"mode": "swap", "async_restore": True, "remaining": "oracle"},
        "workload": {"max_tokens_mode": "trace"},
    },
    "srpt": {"scheduler": {"policy": "srpt"}, "preemption": {"remaining": "learned"}},
    # arrivals too long for the model end ABORTED at once, some of them inside runs
    "score_learned_aborts": {
        "model": {"max_model_len": 2048},
        "scheduler": {"policy": "priority_score"},
        "preemption": {"remaining": "learned"},
        "workload": {"max_tokens_mode": "fixed", "max_tokens_fixed": 1024},
    },
    # Policies that decide inside what would be runs: priority preemptions with no rate
    # cap, time sharing, MLFQ demotions and starvation checks, SRPT's starvation clock.
    "score_uncapped": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {
            "max_preemption_per_min": None,
            "mode": "swap",
            "priority_weights": {"age": 0.05, "sla": 2.0, "tokens": 0.5},
        },
        "workload": {"sla_mix": {0: 0.6, 1: 0.3, 2: 0.1}},
    },
    "score_quantum_oracle": {
        "scheduler": {"policy": "priority_score"},
        "preemption": {"slice_mode": "quantum", "max_preemption_per_min": None, "remaining": "oracle"},
    },
    "fastserve_mlfq": {
        "scheduler": {"policy": "fastserve_mlfq"},
        "preemption": {"mlfq": {"starvation_every_steps": 40, "starvation_s": 0.5}},
    },
    "srpt_starving": {
        "scheduler": {"policy": "srpt"},
        "preemption": {"srpt_starvation_s": 0.5, "remaining": "oracle"},
    },
    "sglang_fcfs": {"scheduler": {"policy": "sglang_fcfs"}},
    "azure_code_tight": {
        "cache": {"num_blocks": 250},
        "workload": {"trace": "azure-code", "rate_scale": 3.0},
    },
}


def _drawn(index: int) -> dict:
    """A config drawn from the knobs that decide when runs start and end (seats, blocks,
    token budget, first-chunk admission, policy, what happens to a victim's KV, load)."""
    rng = random.Random(index)
    return {
        "seed": index,
        "cache": {"num_blocks": rng.choice([100, 200, 400])},
        "scheduler": {
            "policy": rng.choice(["vllm_fcfs", "vllm_priority", "priority_score", "fastserve_mlfq"]),
            "max_num_seqs": rng.choice([4, 16, 64]),
            "max_num_batched_tokens": rng.choice([512, 2048]),
            "reserve_full_sequence": rng.random() < 0.5,
        },
        "preemption": {"mode": rng.choice(["recompute", "swap", "swap_zstd", "pause"])},
        "workload": {
            "trace": rng.choice(["azure-conv", "azure-code"]),
            "rate_scale": rng.choice([2.0, 6.0, 12.0]),
            "duration_s": 30,
            "max_tokens_mode": rng.choice(["fixed", "trace"]),
        },
    }


CASES.update({f"drawn_{index}": _drawn(index) for index in range(12)})


def _config(name: str):
    data = json.loads(json.dumps(_BASE))
    for section, values in CASES[name].items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return build_config(data)


def _outcome(config, decode_runs: bool) -> tuple[dict, int]:
    engine = Engine(config)
    engine.decode_runs = decode_runs
    requests = build_workload(config.workload, seed=config.seed)
    engine.run(requests)
    engine.close()
    fields = [
        f.name for f in dataclasses.fields(requests[0]) if f.name not in ("prompt_token_ids", "sampling")
    ]
    outcome = {
        "requests": [repr([getattr(r, name) for name in fields]) for r in requests],
        "records": [repr(dataclasses.astuple(record)) for record in engine.scheduler.records],
        "stats": repr(sorted(engine.stats().items())),
        "clock": repr(engine.clock.now()),
        "free_blocks": engine.block_pool.num_free,
    }
    return outcome, engine.num_decode_run_steps


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_runs_change_nothing(name):
    config = _config(name)
    stepped, none = _outcome(config, decode_runs=False)
    fast, in_runs = _outcome(config, decode_runs=True)
    assert none == 0
    assert fast == stepped
    if name == "sglang_fcfs":
        assert in_runs == 0  # its loop decides every step (SGLang's new-token ratio)
    elif not name.startswith("drawn"):
        assert in_runs > 0
    if name not in ("vllm_fcfs_light", "azure_code_tight", "sglang_fcfs") and not name.startswith("drawn"):
        assert fast["records"]  # under pressure: preemptions between the runs
    if name in ("score_uncapped", "score_quantum_oracle", "fastserve_mlfq", "srpt_starving"):
        assert "'priority'" in "".join(fast["records"])  # displacements where a run would go on


def _decoding_scheduler(num_blocks: int, contexts: list[int], policy: str = "vllm_fcfs") -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        get_policy(policy, PreemptionConfig()),
        BlockPool(num_blocks),
        block_size=4,
    )
    for index, context in enumerate(contexts):
        request = make_request(index, context, 100)
        request.output_token_ids = [1]
        request.num_computed_tokens = request.num_tokens - 1
        request.block_ids = scheduler.block_pool.allocate(-(-request.num_computed_tokens // 4))
        scheduler.running.append(request)
    return scheduler


def test_a_run_stops_before_the_pool_runs_out():
    # Contexts 4, 6, 8 computed tokens in blocks of 4 (rooms 0, 2, 0): requests 0 and 2
    # need a block in step 1, request 1 in step 3, then 0 and 2 again in step 5.
    scheduler = _decoding_scheduler(num_blocks=5 + 2, contexts=[4, 6, 8])
    run = scheduler.decode_run(0.0)
    assert (run.requests, run.max_steps) == (scheduler.running, 2)  # step 3's block is missing
    assert scheduler.decode_run_allocations(run, 2) == [(1, 0), (1, 2)]
    assert scheduler.decode_run_allocations(run, 1) == [(1, 0), (1, 2)]
    scheduler.block_pool.free(run.requests[2].block_ids[-1:])
    run = scheduler.decode_run(0.0)
    assert run.max_steps == 4  # 3 free: step 5 needs two more
    assert scheduler.decode_run_allocations(run, 4) == [(1, 0), (1, 2), (3, 1)]
    scheduler.block_pool.allocate(2)  # 1 free: step 1 needs 2
    assert scheduler.decode_run(0.0) is None  # a memory preemption first
    bigger = _decoding_scheduler(num_blocks=100, contexts=[4, 6, 8])
    assert bigger.decode_run(0.0).max_steps == 99  # 100 tokens, 1 made: the first finish


def test_a_waiting_head_stays_out_only_when_it_cannot_get_in():
    scheduler = _decoding_scheduler(num_blocks=3 + 4, contexts=[4, 6])  # 4 free; step 1 takes 1
    scheduler.add_request(make_request(9, 11, 5))  # an 11-token prompt: 3 blocks
    assert scheduler.decode_run(0.0) is None  # 3 left after step 1's decode: admitted then
    scheduler.add_request(make_request(10, 2, 5))  # behind the head: never looked at
    taken = scheduler.block_pool.allocate(1)
    run = scheduler.decode_run(0.0)  # 2 left after step 1, and only fewer later
    assert scheduler.decode_run_allocations(run, 5) == [(1, 0), (3, 1), (5, 0)]
    scheduler.block_pool.free(taken)
    assert scheduler.decode_run(0.0) is None
    scheduler.config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    assert scheduler.decode_run(0.0) is not None  # no seat: blocks do not matter


def test_no_decode_run_when_the_next_step_decides_something():
    scheduler = _decoding_scheduler(num_blocks=20, contexts=[4, 6])
    assert scheduler.decode_run(0.0) is not None
    scheduler.running[1].num_computed_tokens -= 1  # its last chunk has two tokens
    assert scheduler.decode_run(0.0) is None
    scheduler.running[1].num_computed_tokens += 1
    scheduler.gate.backoff.until_s = 1.0  # a backoff holds the new head out till then
    scheduler.add_request(make_request(9, 2, 5))  # it fits: admitted once the backoff ends
    assert scheduler.decode_run(0.5).until_s == 1.0  # the run ends there (Engine._decode_run)
    assert scheduler.decode_run(1.0) is None
    scheduler.waiting.pop()
    scheduler.add_request(make_request(10, 200, 5))  # 50 blocks: it never fits
    assert scheduler.decode_run(1.0).challenger is None  # vLLM's policy displaces nobody
    priority = _decoding_scheduler(num_blocks=20, contexts=[4, 6], policy="priority_score")
    assert priority.decode_run(0.0).challenger is None
    priority.add_request(make_request(9, 200, 5))
    # it may displace someone for the head: each step of the run asks (apply_decode_run)
    assert priority.decode_run(0.0).challenger is priority.waiting.peek()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_run_cut_by_the_pool_matches_stepping(mode):
    # Six requests admitted at once on their first chunk, outputs far past what 40 blocks
    # hold: runs end where the pool would run dry, a memory preemption follows, and the
    # victims come back once others finish.
    def outcome(decode_runs: bool):
        config = small_config(
            model={"backend": "null"},
            cache={"num_blocks": 40},
            scheduler={"reserve_full_sequence": False},
            preemption={"mode": mode, "host_mem": "64MB", "slot_size": "1MB"},
        )
        engine = Engine(config)
        engine.decode_runs = decode_runs
        requests = [make_request(i, 5 + 3 * i, 60 + 7 * i, arrival_s=0.001 * i) for i in range(6)]
        runs = []  # (first finish, steps the pool allows)
        original = engine.scheduler.decode_run

        def noted(now):
            run = original(now)
            if run is not None:
                first_finish = min(r.output_limit - r.num_output_tokens for r in run.requests)
                runs.append((first_finish, run.max_steps))
            return run

        engine.scheduler.decode_run = noted
        engine.run(requests)
        return (
            [(r.output_token_ids, r.finish_s, r.num_preemptions, r.executed_s) for r in requests],
            [dataclasses.astuple(record) for record in engine.scheduler.records],
            engine.clock.now(),
            engine.num_steps,
        ), runs

    stepped, _ = outcome(False)
    fast, runs = outcome(True)
    assert fast == stepped
    assert stepped[1]  # it preempted
    assert any(allowed < finish for finish, allowed in runs)  # some run was cut by the pool


def test_a_run_goes_on_past_arrivals_that_queue_behind_a_head_that_stays_out(monkeypatch):
    """Under pressure the queue's head waits for blocks through most decode steps, and
    requests keep arriving behind it: runs go on past them (the comparison above checks
    that this changes nothing); an arrival that would lead the queue ends the run."""
    config = _config("vllm_fcfs")
    joined, led = [], []  # arrivals a run found behind the head, and in front of it
    original = Scheduler.queues_behind_head

    def counted(self, request):
        behind = original(self, request)
        (joined if behind else led).append(request.request_id)
        return behind

    monkeypatch.setattr(Scheduler, "queues_behind_head", counted)
    engine = Engine(config)
    engine.run(build_workload(config.workload, seed=config.seed))
    assert joined  # runs went on past arrivals
    # each request queued once: by the run it landed in or by the loop, never by both
    assert engine.num_added == len(build_workload(config.workload, seed=config.seed))


def test_runs_go_on_while_the_backoff_holds_a_new_head_out(monkeypatch):
    """After a preemption failure the backoff keeps new requests out: runs go on through
    it and end where it ends (the comparison above checks that this changes nothing)."""
    config = _config("score_quantum_oracle")
    held = []
    original = Scheduler.decode_run

    def noted(self, now):
        run = original(self, now)
        if run is not None and run.until_s != float("inf"):
            held.append(run.until_s)
        return run

    monkeypatch.setattr(Scheduler, "decode_run", noted)
    engine = Engine(config)
    engine.run(build_workload(config.workload, seed=config.seed))
    assert held and engine.scheduler.num_preemption_failed


class StepwiseMlfq(FastServeMlfqPolicy):
    """FastServe's policy with its per-step state but without the batch form."""

    quiet_steps = SchedulingPolicy.quiet_steps
    on_decode_run = SchedulingPolicy.on_decode_run

    def on_step(self, ran, step_s, now):
        return FastServeMlfqPolicy.on_decode_run(self, ran, (step_s,), (now,))


def test_a_policy_with_per_step_state_and_no_batch_form_steps_every_step():
    """A policy that overrides `on_step` alone is stepped (runs would skip its state):
    the same outcome as FastServe's, and no runs; with the batch form it takes runs."""
    config = _config("fastserve_mlfq")
    assert get_policy("fastserve_mlfq", config.preemption).takes_decode_runs
    assert not StepwiseMlfq(config.preemption).takes_decode_runs
    stepwise = config.model_copy(
        update={"scheduler": config.scheduler.model_copy(update={"policy": f"{__name__}:StepwiseMlfq"})}
    )
    outcome, in_runs = _outcome(stepwise, decode_runs=True)
    assert in_runs == 0
    assert outcome == _outcome(config, decode_runs=False)[0]
