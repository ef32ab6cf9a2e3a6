import pytest

from preempt.clock import VirtualClock, WallClock
from preempt.cost_model import TARGETS, CostModel, StepShape, get_target


def test_llama3_8b_kv_bytes_and_capacity():
    target = get_target("h200-llama3-8b")
    # 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token
    assert target.kv_bytes_per_token == 131072
    # (141 GB x 0.9 - 2 GB reserve - 16.06 GB weights) / 128 KiB ~ 830k tokens
    assert 800_000 < target.kv_capacity_tokens < 860_000


def test_decode_is_memory_bound_and_prefill_compute_bound():
    cost = CostModel(get_target("h200-llama3-8b"))
    decode = cost.step_time_s(StepShape(num_tokens=1, sum_attn_ctx=1000, sum_kv_read=1000))
    # one 8B decode step streams 16 GB of weights at 0.8 x 4.8 TB/s ~ 4.2 ms (+1 ms overhead)
    assert 0.004 < decode < 0.007
    prefill = cost.step_time_s(StepShape(num_tokens=2048, sum_attn_ctx=2048 * 1024, sum_kv_read=2048))
    assert prefill > 10 * decode  # 2k-token prefill is compute bound
    assert cost.step_time_s(StepShape(0, 0, 0)) == 0.0


def test_more_work_never_takes_less_time():
    cost = CostModel(get_target("4xh200-llama3-70b"))
    times = [cost.step_time_s(StepShape(n, n * 500, n * 500)) for n in (1, 8, 64, 512, 4096)]
    assert times == sorted(times)


def test_every_target_states_its_sources():
    for target in TARGETS.values():
        assert target.sources and target.kv_capacity_tokens > 0


def test_unknown_target_names_the_choices():
    with pytest.raises(ValueError, match="h200-llama3-8b"):
        get_target("a100")


def test_virtual_clock_moves_only_when_told():
    clock = VirtualClock()
    clock.advance(0.5)
    clock.wait_until(0.2)  # never backwards
    assert clock.now() == 0.5
    clock.wait_until(2.0)
    assert clock.now() == 2.0
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_wall_clock_is_real_time():
    clock = WallClock()
    start = clock.now()
    clock.wait_until(start + 0.01)
    assert clock.now() >= start + 0.01
