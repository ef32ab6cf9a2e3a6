import math
import re

import pytest

from preempt.core.clock import VirtualClock, WallClock
from preempt.core.cost_model import CostModel, StepShape, smooth_max
from preempt.core.profiles import MODELS, TARGETS, DeviceProfile, ProfileError, TargetProfile, get_target


def test_llama3_8b_kv_bytes_and_capacity():
    target = get_target("h200-llama3-8b")
    # 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token
    assert target.kv_bytes_per_token == 131072
    assert target.model.num_params == pytest.approx(8.03e9, rel=0.002)  # config.json's count
    # vLLM: 143,771 MiB x 0.9 - 2 GB reserve - 16.06 GB weights, / 128 KiB ~ 898k tokens
    expected = (143771 * 2**20 * 0.9 - 2e9 - target.weight_bytes) // 131072
    assert target.kv_capacity_tokens == expected
    assert 890_000 < target.kv_capacity_tokens < 905_000  # not 141e9 bytes (~830k)


def test_decode_is_weight_bound_and_prefill_compute_bound():
    cost = CostModel(get_target("h200-llama3-8b"))
    decode = cost.step_time_s(StepShape(1, 1000, 1000, 1))
    # one decode streams ~16 GB of weights: at 4.8 TB/s that alone is 3.3 ms, plus floors + 1 ms host
    weights_s = get_target("h200-llama3-8b").weight_bytes / 4.8e12
    assert weights_s + 1e-3 < decode < 2 * weights_s + 1e-3
    prefill = cost.step_time_s(StepShape(2048, 2048 * 1024, 2048, 1))
    assert prefill > 5 * decode  # 2k-token prefill is compute bound
    assert cost.step_time_s(StepShape(0, 0, 0, 0)) == 0.0


def test_lm_head_only_for_sampled_positions():
    cost = CostModel(get_target("h200-llama3-8b"))
    one_sampled = cost.op_times(StepShape(2048, 2048 * 1024, 2048, 1))
    all_sampled = cost.op_times(StepShape(2048, 2048 * 1024, 2048))  # num_seqs unknown: every token
    assert one_sampled.lm_head < all_sampled.lm_head / 10  # 1 row: weight-bound; 2048 rows: FLOP-bound
    assert one_sampled.linear == all_sampled.linear


def test_smooth_max_rounds_the_knee():
    assert smooth_max(3.0, 0.0, 2.0) == 3.0
    assert smooth_max(1.0, 1.0, 2.0) == pytest.approx(2**0.5)
    assert max(1.0, 1.0) < smooth_max(1.0, 1.0, 4.0) < smooth_max(1.0, 1.0, 2.0)


def test_tensor_parallel_pays_two_all_reduces_a_layer():
    target = get_target("4xh200-llama3-70b")
    cost = CostModel(target)
    times = cost.op_times(StepShape(1, 500, 500, 1))
    latency, _ = target.device.all_reduce[4]
    assert times.all_reduce >= 2 * target.num_layers * latency
    assert CostModel(get_target("h200-llama3-8b")).op_times(StepShape(1, 500, 500, 1)).all_reduce == 0.0


def test_more_work_never_takes_less_time():
    cost = CostModel(get_target("4xh200-llama3-70b"))
    times = [cost.step_time_s(StepShape(n, n * 500, n * 500, n)) for n in (1, 8, 64, 512, 4096)]
    assert times == sorted(times)


def test_duplex_copy_link():
    cost = CostModel(get_target("h200-llama3-8b"))
    device = cost.target.device
    one_way = cost.copy_time_s(1e9)
    both = cost.copy_time_s(1e9, both_ways=True)
    assert one_way == pytest.approx(device.copy_latency_s + 1e9 / device.copy_one_way_bytes_per_s)
    assert both == pytest.approx(device.copy_latency_s + 2e9 / device.copy_both_ways_bytes_per_s)
    assert one_way < both < 2 * one_way  # sharing the link is slower, but not serial
    assert cost.pcie_time_s(1e9) == one_way


def test_every_target_and_constant_states_its_source():
    for target in TARGETS.values():
        assert target.kv_capacity_tokens > 0
        for name in ("linear_flops_per_s", "attn_floor_s", "all_reduce", "mem_total_bytes", "copy_latency_s"):
            assert target.device.sources.get(name), (target.name, name)


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


def test_attention_charges_query_rows_and_the_kernels_share_of_masked_pairs():
    base = get_target("h200-llama3-8b")
    chunk = 2048
    masked = chunk * (chunk - 1) // 2
    shape = StepShape(chunk, chunk * (chunk + 1) // 2, chunk, 1, sum_masked_ctx=masked)

    def attention(step=shape, **changes):
        device = DeviceProfile.from_dict({**base.device.to_dict(), **changes})
        return CostModel(TargetProfile("t", base.model, 1, device)).op_times(step).attention

    # a kernel that skips masked tiles pays the causal pairs only, as if none were masked
    assert attention(attn_masked_share=0.0) == attention(shape._replace(sum_masked_ctx=0))
    # one that computes them pays for the whole square: as many pairs as chunk x chunk causal ones
    full_square = shape._replace(sum_attn_ctx=chunk * chunk, sum_masked_ctx=0)
    assert attention(attn_masked_share=1.0) == pytest.approx(attention(full_square, attn_masked_share=0.0))
    assert attention(attn_masked_share=1.0) > attention(attn_masked_share=0.0)
    # the per-row term: each of the chunk's rows but its first, each query head, every layer;
    # a decode has none
    more = base.device.attn_per_row_head_s + 1e-7
    extra = attention(attn_per_row_head_s=more) - attention()
    assert extra == pytest.approx(
        base.model.num_layers * base.model.num_q_heads * (chunk - 1) * 1e-7, rel=1e-6
    )
    decode = StepShape(8, 8 * 1000, 8 * 1000, 8)
    assert attention(decode, attn_per_row_head_s=more) == attention(decode)


# ------------------------------------------------------------ measured op tables
def _tabled(tokens, seconds, op="mlp_up_proj"):
    """Llama-3-8B on one H200 with one measured table; the formula alone is TARGETS'."""
    data = get_target("h200-llama3-8b").device.to_dict()
    data["op_tables"] = {"llama3-8b/tp1": {op: [tokens, seconds]}}
    return CostModel(TargetProfile("t", MODELS["llama3-8b"], 1, DeviceProfile.from_dict(data)))


def test_a_measured_table_is_reproduced_at_its_counts_and_interpolated_between():
    plain = CostModel(get_target("h200-llama3-8b"))
    up = {t: plain.layer_linear_s(t)["mlp_up_proj"] for t in (1, 64, 256, 1024, 8192)}
    # measured: 1.2x the formula at 64, 0.8x at 1024
    tabled = _tabled([64, 1024], [1.2 * up[64], 0.8 * up[1024]])
    assert tabled.measured_ops == ("mlp_up_proj",)
    assert tabled.layer_linear_s(64)["mlp_up_proj"] == pytest.approx(1.2 * up[64])
    assert tabled.layer_linear_s(1024)["mlp_up_proj"] == pytest.approx(0.8 * up[1024])
    # halfway in log(tokens): the geometric mean of the two corrections
    assert tabled.layer_linear_s(256)["mlp_up_proj"] == pytest.approx(math.sqrt(1.2 * 0.8) * up[256])
    # beyond the table: the end's correction times the formula's own trend
    assert tabled.layer_linear_s(8192)["mlp_up_proj"] == pytest.approx(0.8 * up[8192])
    assert tabled.layer_linear_s(1)["mlp_up_proj"] == pytest.approx(1.2 * up[1])
    # other operators, and other models or GPU counts, stay on the formula
    assert tabled.layer_linear_s(256)["mlp_down_proj"] == plain.layer_linear_s(256)["mlp_down_proj"]
    other = CostModel(TargetProfile("t", MODELS["llama3-70b"], 1, tabled.target.device))
    assert other.measured_ops == ()


def test_measured_tables_change_the_step_time_only_through_their_ops():
    plain = CostModel(get_target("h200-llama3-8b"))
    a = plain.elementwise_s("add", 128)
    tabled = _tabled([16, 512], [2 * plain.elementwise_s("add", t) for t in (16, 512)], "add")
    shape = StepShape(128, 128 * 500, 128 * 500, 128)
    layers = get_target("h200-llama3-8b").model.num_layers
    assert tabled.elementwise_s("add", 128) == pytest.approx(2 * a)
    assert tabled.step_time_s(shape) - plain.step_time_s(shape) == pytest.approx(layers * a)


@pytest.mark.parametrize(
    "tables, message",
    [
        ({"llama3-8b": {}}, "expected 'model/tpN'"),
        ({"llama3-8b/tp1": {"softmax": [[1, 2], [1e-5, 1e-5]]}}, "softmax: unknown operator"),
        ({"llama3-8b/tp1": {"add": [[2, 1], [1e-5, 1e-5]]}}, "strictly ascending"),
        ({"llama3-8b/tp1": {"add": [[1, 2, 3], [1e-5, 1e-5]]}}, "differ in length"),
        ({"llama3-8b/tp1": {"add": [[1, 2], [1e-5, -1.0]]}}, "must be > 0"),
        ({"llama3-8b/tp1": {"add": [1, 2]}}, "expected [token counts, seconds]"),
    ],
)
def test_a_malformed_op_table_is_refused_naming_it(tables, message):
    data = get_target("h200-llama3-8b").device.to_dict()
    data["op_tables"] = tables
    with pytest.raises(ProfileError, match=re.escape(message)):
        DeviceProfile.from_dict(data, where="p.json: device")


def test_a_profile_without_op_tables_still_loads_and_round_trips_with_them():
    data = get_target("h200-llama3-8b").device.to_dict()
    del data["op_tables"]  # profiles written before the tables
    assert DeviceProfile.from_dict(data).op_tables == {}
    data["op_tables"] = {"llama3-8b/tp1": {"add": [[1, 8], [2e-6, 3e-6]]}}
    device = DeviceProfile.from_dict(data)
    assert (
        DeviceProfile.from_dict(device.to_dict()).op_tables
        == device.op_tables
        == {"llama3-8b/tp1": {"add": ((1, 8), (2e-6, 3e-6))}}
    )


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_decode_step_costs_the_same_float_either_way(name):
    # The engine's decode runs price steps with decode_step_time_s: any difference, even in
    # the last bit, would move the virtual clock of every replay.
    target = get_target(name)
    fast, general = CostModel(target), CostModel(target)
    for num_seqs in (1, 2, 7, 64, 255, 1024):
        for per_seq in (1, 17, 500, 4096, 100_000):
            context = num_seqs * per_seq + 3
            shape = StepShape(num_seqs, context, context, num_seqs, 0)
            assert fast.decode_step_time_s(num_seqs, context) == general.step_time_s(shape)
