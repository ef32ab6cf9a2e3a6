"""The engine end to end: correctness against a naive reference, invariants under
random load, reproducibility, and the defined outcomes of impossible requests."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preempt.core.request import RequestState, ScheduledChunk
from preempt.engine.engine import Engine
from preempt.engine.scheduler import SchedulerOutput
from preempt.engine.view import StepOutput
from preempt.model.tiny import generate_naive
from tests.conftest import make_request, small_config


def _mixed_requests(num: int, seed: int = 0):
    # Mixed lengths: prompts 1..70 tokens (several blocks, several prefill chunks), outputs 1..24.
    return [
        make_request(i, 1 + (i * 37) % 70, 1 + (i * 11) % 24, arrival_s=0.01 * i, seed=seed)
        for i in range(num)
    ]


def _assert_matches_naive(engine: Engine, requests) -> None:
    model = engine.runner.model
    for request in requests:
        assert request.state is RequestState.FINISHED
        expected = generate_naive(model, request.prompt_token_ids.tolist(), request.target_output_tokens)
        assert request.output_token_ids == expected, f"request {request.request_id} diverged"


def test_paged_batched_greedy_equals_naive_reference():
    engine = Engine(small_config())
    requests = _mixed_requests(36)
    engine.run(requests)
    assert engine.scheduler.num_preemptions == 0
    _assert_matches_naive(engine, requests)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_greedy_equals_naive_under_heavy_recompute_preemption():
    # 40 blocks x 4 tokens = 160 tokens of KV for 8 concurrent requests of up to 94 tokens;
    # admitting on the first chunk alone (vLLM before scheduler_reserve_full_isl) makes the
    # engine preempt often.
    engine = Engine(small_config(cache={"num_blocks": 40}, scheduler={"reserve_full_sequence": False}))
    requests = _mixed_requests(36, seed=1)
    engine.run(requests)
    assert engine.scheduler.num_preemptions >= 10
    assert sum(r.num_preemptions for r in requests) == engine.scheduler.num_preemptions
    _assert_matches_naive(engine, requests)


def test_priority_policy_also_matches_naive():
    engine = Engine(small_config(cache={"num_blocks": 40}, scheduler={"policy": "vllm_priority"}))
    requests = _mixed_requests(20, seed=2)
    for r in requests[::3]:
        r.sla_level = 1
    engine.run(requests)
    assert engine.scheduler.num_preemptions > 0
    _assert_matches_naive(engine, requests)


def test_generate_api_returns_outputs_in_prompt_order():
    engine = Engine(small_config())
    outs = engine.generate(["hello", "a much longer prompt than the first one"], max_tokens=5)
    assert [len(o) for o in outs] == [5, 5]
    assert outs[0] == generate_naive(engine.runner.model, list(b"hello"), 5)


def test_impossible_requests_end_aborted_with_a_reason():
    engine = Engine(small_config(model={"max_model_len": 64}, cache={"num_blocks": 8}))
    too_long = make_request(0, 60, 10)  # 70 > max_model_len
    too_big = make_request(1, 30, 10)  # 40 tokens = 10 blocks > 8
    fine = make_request(2, 10, 3)
    engine.run([too_long, too_big, fine])
    assert too_long.state is RequestState.ABORTED and too_long.abort_reason.startswith("prompt_too_long")
    assert too_big.state is RequestState.ABORTED and too_big.abort_reason.startswith("exceeds_kv_capacity")
    assert fine.state is RequestState.FINISHED


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 2)), min_size=1, max_size=30
    ),
    num_blocks=st.integers(12, 60),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 48),
    policy=st.sampled_from(
        ["vllm_fcfs", "vllm_priority", "sglang_fcfs", "sglang_priority", "priority_score", "fastserve_mlfq"]
    ),
    mode=st.sampled_from(["recompute", "swap", "swap_zstd", "pause"]),
    host_slots=st.integers(1, 8),
)
def test_invariants_under_random_load(lengths, num_blocks, max_num_seqs, budget, policy, mode, host_slots):
    # The null backend models Llama-3-8B KV (128 KiB/token): slots of 4 MiB hold 32
    # tokens, so small host pools and oversized blobs both happen.
    config = small_config(
        model={"backend": "null"},
        cache={"num_blocks": num_blocks},
        scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget, "policy": policy},
        preemption={
            "mode": mode,
            "min_time_slice_ms": 0,
            "time_slice_strategy": "static",
            "time_slices": {"static_ms": 1.0},
            "host_mem": f"{4 * host_slots}MiB",
            "slot_size": "4MiB",
        },
    )
    engine = Engine(config)
    requests = [
        make_request(i, p, o, arrival_s=0.003 * i, sla_level=s) for i, (p, o, s) in enumerate(lengths)
    ]
    finished_count: dict[int, int] = {}

    def check(output: StepOutput) -> None:
        pool, scheduler = engine.block_pool, engine.scheduler
        pool.check()
        waiting = scheduler.waiting_requests()
        owned = [b for r in scheduler.running + waiting for b in r.block_ids]
        assert len(owned) == len(set(owned)) == pool.num_used  # no block owned twice, none leaked
        # Only paused requests hold blocks while waiting; saved ones hold a host slot.
        assert all(not r.block_ids or r.kv_location == "device" for r in waiting)
        if engine.saver is not None:
            engine.saver.host_pool.check()
            num_saved = sum(r.kv_location == "host" for r in waiting)
            assert engine.saver.host_pool.num_used_slots == num_saved
        # SGLang's decode step runs every running request whatever the token budget, and its
        # prefill chunks are whole pages (at least one).
        limit = budget if scheduler.policy.loop == "vllm" else max(budget, max_num_seqs, engine.block_size)
        assert output.scheduled.num_batched_tokens <= limit
        assert len(output.scheduled.chunks) <= max_num_seqs and len(scheduler.running) <= max_num_seqs
        for r in output.finished:
            finished_count[r.request_id] = finished_count.get(r.request_id, 0) + 1

    engine.run(requests, on_step=check)
    for r in requests:
        assert r.state.is_final
        if r.state is RequestState.FINISHED:
            assert finished_count[r.request_id] == 1
            assert r.num_output_tokens == r.target_output_tokens
        else:
            assert r.abort_reason and r.request_id not in finished_count
    assert engine.block_pool.num_free == num_blocks
    if engine.saver is not None:
        assert engine.saver.host_pool.num_used_slots == 0


def test_step_shape_counts_the_causal_pairs_and_the_masked_ones_inside_each_chunk():
    prefill, decode = make_request(0, 100, 4), make_request(1, 50, 4)
    prefill.num_computed_tokens = 40  # a chunk of 24 after 40 computed tokens
    decode.num_computed_tokens = 50  # one new token
    out = SchedulerOutput([ScheduledChunk(prefill, 24), ScheduledChunk(decode, 1)], [], [], 25, 0.0)
    shape = Engine._step_shape(out)
    assert shape.num_tokens == 25 and shape.num_seqs == 2
    assert shape.sum_attn_ctx == sum(p + 1 for p in range(40, 64)) + 51
    assert shape.sum_kv_read == 64 + 51
    assert shape.sum_masked_ctx == 24 * 23 // 2  # a decode masks nothing
