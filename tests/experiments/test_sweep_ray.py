"""A sweep of 2 points x 2 seeds: the same numbers through Ray as in one process, one
wandb run per point in one group, intervals in summary.csv, bands in the sweep plots,
and derived inputs (a slower copy link, longer prompts) that really change the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from experiments.ablate import ablate
from experiments.catalogue import NOT_REPRODUCIBLE
from experiments.plan import plan_ablation
from experiments.tables import read_csv
from preempt.obs.stats import t_interval

SMOKE = Path("preempt/configs/smoke.yaml")


def _sweep_config(tmp_path: Path, duration_s: float = 10, **changes) -> Path:
    base = yaml.safe_load(SMOKE.read_text())["base"]
    base["workload"]["duration_s"] = duration_s
    config = {
        "name": "sweep-test",
        "base": base,
        "arms": ["swap_raw"],
        "grid": {"workload.rate_scale": [4.0, 8.0]},
        "seeds": [0, 1],
        **changes,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if key in NOT_REPRODUCIBLE or key.startswith("wall_time_s"):
            continue
        if isinstance(value, float) and math.isnan(value):
            assert isinstance(b[key], float) and math.isnan(b[key]), key
        else:
            assert value == b[key], key


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    config = _sweep_config(tmp)
    local = ablate(config, tmp / "local", wandb="disabled", jobs=1, log=lambda _: None)
    ray = ablate(config, tmp / "ray", wandb="offline", jobs=2, log=lambda _: None)
    return tmp, local, ray


def test_ray_gives_the_same_numbers_as_a_local_run(sweeps):
    tmp, local, ray = sweeps
    assert [r["run"] for r in local.rows] == [
        "swap_raw@rate_scale=4.0,seed=0",
        "swap_raw@rate_scale=4.0,seed=1",
        "swap_raw@rate_scale=8.0,seed=0",
        "swap_raw@rate_scale=8.0,seed=1",
    ]
    for name in ("results.csv", "summary.csv"):
        for a, b in zip(read_csv(tmp / "local" / name), read_csv(tmp / "ray" / name), strict=True):
            _same(a, b)
    assert all(r["status"] == "ok" for r in ray.rows)
    # the seeds differ (SLA classes are drawn per seed), so the intervals are real ones
    assert local.rows[0]["sla2_ttft_p99_s"] != local.rows[1]["sla2_ttft_p99_s"]


def test_a_ray_cluster_at_an_address_gives_the_same_numbers(sweeps, tmp_path):
    """`--ray-address`: a real two-node cluster (Ray's own `cluster_utils`, separate
    raylets and workers, as Ray's tests use), joined by address like a remote one. A sweep
    given no address meanwhile starts a Ray of its own: it neither joins that cluster (a
    user's, running here) nor stops it."""
    from ray.cluster_utils import Cluster

    tmp, local, _ = sweeps
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    address = cluster.address  # host:port of the head's GCS, as `ray start --head` prints it
    try:
        result = ablate(
            _sweep_config(tmp_path),
            tmp_path / "cluster",
            wandb="disabled",
            ray_address=address,
            log=lambda _: None,
        )
        config = _sweep_config(tmp_path)
        alone = ablate(config, tmp_path / "alone", wandb="disabled", jobs=2, log=lambda _: None)
        assert cluster.remaining_processes_alive()  # its nodes still up
    finally:
        cluster.shutdown()
    assert result.info["ray_address"] == address and alone.info["ray_address"] is None
    for out in ("cluster", "alone"):
        for name in ("results.csv", "summary.csv"):
            for a, b in zip(read_csv(tmp / "local" / name), read_csv(tmp_path / out / name), strict=True):
                _same(a, b)


def test_summary_rows_hold_t_intervals_over_the_seeds(sweeps):
    _, local, _ = sweeps
    point = next(p for p in local.points if p["run"] == "swap_raw@rate_scale=8.0")
    seeds = [r for r in local.rows if r["run"].startswith("swap_raw@rate_scale=8.0,")]
    expected = t_interval([r["goodput_req_s"] for r in seeds])
    assert point["num_seeds"] == 2 and point["seeds"] == "0 1"
    assert point["goodput_req_s"] == pytest.approx(expected.mean)
    assert point["goodput_req_s_lo"] == pytest.approx(expected.lo)
    assert point["goodput_req_s_hi"] == pytest.approx(expected.hi)


def test_one_wandb_run_per_point_in_one_group_and_band_plots(sweeps):
    tmp, _, ray = sweeps
    out = tmp / "ray"
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 + 1  # one per point (seeds logged as its steps) + the summary
    assert ray.info["seeds"] == [0, 1] and ray.info["wandb"] == "offline"
    for name in ("goodput_req_s", "ttft_p99_s", "tpot_p99_s"):
        assert (out / "plots" / f"sweep_{name}_vs_rate_scale.png").stat().st_size > 5_000
    text = (out / "results.md").read_text()
    assert "95% interval" in text and "swap_raw@rate_scale=8.0 | 2 |" in text


def test_derived_link_and_prompt_inputs_change_the_run(tmp_path):
    path = _sweep_config(
        tmp_path, 30, grid={"derive.link_gb_s": [50, 5], "derive.prompt_scale": [1, 2]}, seeds=None
    )
    plan = plan_ablation(path, tmp_path / "out")
    slow = plan.run("swap_raw@link_gb_s=5,prompt_scale=2")
    target = json.loads(Path(slow.config.clock.target).read_text())
    assert target["device"]["copy_one_way_bytes_per_s"] == 5e9 and target["model"]["num_layers"] == 32
    assert Path(slow.config.workload.trace).parent == tmp_path / "out" / "inputs"
    result = ablate(path, tmp_path / "out", wandb="disabled", jobs=1, plots=False, log=lambda _: None)
    by_run = {r["run"]: r for r in result.rows}
    fast, slow = by_run["swap_raw@link_gb_s=50,prompt_scale=1"], by_run["swap_raw@link_gb_s=5,prompt_scale=1"]
    assert slow["save_ms_p50"] > 5 * fast["save_ms_p50"]  # 10x slower link, same KV
    longer = by_run["swap_raw@link_gb_s=50,prompt_scale=2"]
    assert longer["ttft_p50_s"] > fast["ttft_p50_s"]
    bad = _sweep_config(tmp_path, grid={"derive.link_gb_s": [0]})
    with pytest.raises(ValueError, match="derive.link_gb_s"):
        plan_ablation(bad, tmp_path / "bad")


def test_slice_scale_and_sla_mix_set_the_config_and_change_time_sharing(tmp_path):
    path = _sweep_config(
        tmp_path,
        20,
        arms=["time_share_uncapped"],
        grid={"derive.slice_scale": [1, 16], "derive.sla_mix": ["70-20-10", "34-33-33"]},  # keys sorted
        seeds=None,
    )
    plan = plan_ablation(path, tmp_path / "out")
    long = plan.run("time_share_uncapped@sla_mix=34-33-33,slice_scale=16").config
    slices = long.preemption.time_slices
    assert (slices.static_ms, slices.long_ms, slices.medium_ms, slices.short_ms) == (320, 800, 320, 160)
    assert long.preemption.min_time_slice_ms == 160
    assert long.workload.sla_mix == {0: 0.34, 1: 0.33, 2: 0.33}
    base = plan.run("time_share_uncapped@sla_mix=70-20-10,slice_scale=1").config
    assert base.preemption.time_slices.static_ms == 20 and base.workload.sla_mix == {0: 0.7, 1: 0.2, 2: 0.1}
    result = ablate(path, tmp_path / "out", wandb="disabled", jobs=1, plots=False, log=lambda _: None)
    by_run = {r["run"]: r for r in result.rows}
    short, longer = (by_run[f"time_share_uncapped@sla_mix=70-20-10,slice_scale={s}"] for s in (1, 16))
    assert longer["num_preemptions"] < short["num_preemptions"]  # longer slices, fewer yields
    for bad, match in (("70-20", "sum to 100"), ("a-b", "percentages like")):
        config = _sweep_config(tmp_path, grid={"derive.sla_mix": [bad]})
        with pytest.raises(ValueError, match=match):
            plan_ablation(config, tmp_path / "bad")


def test_regime_table_has_a_row_per_point_with_intervals(sweeps):
    from experiments.regimes import regime_table
    from experiments.tables import interval_cell

    tmp, local, _ = sweeps
    lines = regime_table(tmp / "local").splitlines()
    assert "swap_raw stall share" in lines[0] and "swap_raw save ms p50" in lines[0]
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 4.0", "| 8.0"]
    point = next(p for p in local.points if p["run"] == "swap_raw@rate_scale=8.0")
    assert lines[3].split(" | ")[1] == interval_cell(point, "stall_share")


def test_replicate_gives_each_seed_its_own_trace_window(tmp_path):
    path = _sweep_config(tmp_path, replicate={"workload.start_s": [0, 600]})
    plan = plan_ablation(path, tmp_path / "out")
    starts = {run.key: run.config.workload.start_s for run in plan.runs}
    assert starts["swap_raw@rate_scale=4.0,seed=0"] == 0 and starts["swap_raw@rate_scale=8.0,seed=1"] == 600
    bad = _sweep_config(tmp_path, replicate={"workload.start_s": [0]})
    with pytest.raises(ValueError, match="replicate 'workload.start_s': needs one value per seed"):
        plan_ablation(bad, tmp_path / "bad")
    # An arm that sets a replicated key itself keeps its value at every seed.
    pinned = _sweep_config(
        tmp_path,
        arms=["swap_raw", {"name": "pinned", "parent": "swap_raw", "set": {"workload.start_s": 30}}],
        replicate={"workload.start_s": [0, 600]},
    )
    starts = {run.key: run.config.workload.start_s for run in plan_ablation(pinned, tmp_path / "p").runs}
    assert starts["pinned@rate_scale=4.0,seed=1"] == 30 and starts["swap_raw@rate_scale=4.0,seed=1"] == 600


def test_quick_seeds_are_samples_of_the_workload(tmp_path):
    """Each seed of the main job's ablation replays its own minute of the trace (so an arm
    blind to SLA classes does not repeat exactly), none inside the predictor's training
    windows; the tiny arms keep the first 30 s (their cost)."""
    from preempt.cli.main_job import TRAIN_WINDOWS_START_S

    plan = plan_ablation(Path("preempt/configs/quick.yaml"), tmp_path / "q")
    starts = {run.key: run.config.workload.start_s for run in plan.runs}
    fcfs = [starts[f"vllm_fcfs@seed={seed}"] for seed in range(5)]
    assert len(set(fcfs)) == 5
    for start in fcfs:
        assert all(start + 60 <= train or start >= train + 200 for train in TRAIN_WINDOWS_START_S)
    assert {starts[f"tiny_swap_mixed@seed={seed}"] for seed in range(5)} == {0}
