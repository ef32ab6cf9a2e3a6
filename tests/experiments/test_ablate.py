"""`preempt ablate` on the smoke config: every arm in the table, metrics defined, plots,
wandb offline runs, reproducible arms; bad configs fail before anything runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from experiments.arms import STANDARD_ARMS
from experiments.catalogue import METRICS, NOT_REPRODUCIBLE, SLA_METRICS, undefined_reason
from experiments.execution import run_arm
from experiments.plan import plan_ablation
from experiments.tables import read_csv
from preempt.cli import main

SMOKE = Path("preempt/configs/smoke.yaml")
PLOTS = ("ttft_cdf", "tpot_cdf", "preemptions_over_time", "goodput", "stall_per_preemption", "bytes_saved")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "smoke"
    assert (
        main(["ablate", "--config", str(SMOKE), "--out", str(out), "--wandb", "offline", "--jobs", "2"]) == 0
    )
    return out


def _nan_is_explained(smoke: Path, row: dict, column: str) -> bool:
    """A NaN is accepted only when its documented reason holds for this run: the reason is
    checked against the run's own requests and counts, not only named."""
    reason = undefined_reason(row, column)
    if not reason:
        return False
    if reason == "not reported by this engine version":
        return False  # this engine reports every column
    if reason.startswith("recompute mode"):
        return row["mode"] == "recompute"
    base = column.split("_", 1)[1] if column.startswith("sla") else column
    if base in SLA_METRICS:
        requests = pq.read_table(smoke / "arms" / row["run"] / "requests.parquet").to_pylist()
        if column.startswith("sla"):
            level = int(column[len("sla") :].split("_", 1)[0])
            requests = [r for r in requests if r["sla_level"] == level]
        if base in ("slo_attainment", "goodput_req_s"):
            return not requests
        return not [
            r
            for r in requests
            if r["final_state"] == "FINISHED" and (base.startswith("ttft") or r["output_tokens"] > 1)
        ]
    return True  # the other reasons test the row's own counts (catalogue.undefined_reason)


def test_smoke_table_has_every_arm_and_no_missing_metric(smoke):
    rows = read_csv(smoke / "results.csv")
    config = yaml.safe_load(SMOKE.read_text())
    arms = [a if isinstance(a, str) else a["name"] for a in config["arms"]]
    assert [row["run"] for row in rows] == arms
    assert all(row["status"] == "ok" for row in rows), [row["notes"] for row in rows]
    for row in rows:
        for column in (*METRICS, *(c for c in row if c.startswith("sla"))):
            value = row[column]
            assert isinstance(value, int | float), (row["run"], column, value)
            if math.isnan(value):  # only where the metric is undefined, for a reason that holds
                why = undefined_reason(row, column)
                assert _nan_is_explained(smoke, row, column), (row["run"], column, why)
    by_run = {row["run"]: row for row in rows}
    assert by_run["vllm_fcfs"]["num_preemptions"] > 0 and by_run["score"]["num_priority_preemptions"] > 0
    assert by_run["swap_zstd"]["num_saves"] > 0 and not math.isnan(by_run["swap_zstd"]["save_ms_p50"])
    # output quality: real tokens only; the lossy arm is scored against the lossless reference
    assert math.isnan(by_run["swap_mixed"]["token_agreement"])  # null backend: placeholders
    mixed = by_run["tiny_swap_mixed"]
    assert 0 <= mixed["token_agreement"] <= 1 and 0 <= mixed["exact_match_share"] <= 1
    assert mixed["num_restores"] > 0


def test_smoke_writes_markdown_plots_and_offline_wandb_runs(smoke, capsys):
    text = (smoke / "results.md").read_text()
    assert "| vllm_fcfs |" in text and "tiny_swap_mixed" in text
    for name in PLOTS:
        assert (smoke / "plots" / f"{name}.png").stat().st_size > 5_000, name
    runs = sorted((smoke / "wandb").glob("offline-run-*"))
    assert len(runs) == 21 + 1  # one per arm, plus the summary run with the table and plots
    info = json.loads((smoke / "ablation.json").read_text())
    assert info["wandb"] == "offline" and "wandb sync" in info["wandb_sync"]
    assert {run["run"] for run in info["runs"]} >= {"early_oracle", "swap_mixed"}
    oracle = next(run for run in info["runs"] if run["run"] == "early_oracle")
    assert oracle["config"]["early_save"]["oracle_log"].endswith("arms/swap_mixed/preemptions.parquet")


@pytest.mark.parametrize("arm", ["swap_zstd", "tiny_swap_mixed"])
def test_rerunning_an_arm_gives_identical_metrics(smoke, tmp_path, arm):
    info = json.loads((smoke / "ablation.json").read_text())
    config = next(run["config"] for run in info["runs"] if run["run"] == arm)
    outcome = run_arm(arm, config, str(tmp_path / arm))
    assert outcome["status"] == "ok", outcome.get("error")
    row = next(row for row in read_csv(smoke / "results.csv") if row["run"] == arm)
    for key, value in outcome["metrics"].items():
        if key in NOT_REPRODUCIBLE or key in ("token_agreement", "exact_match_share"):
            continue
        assert value == row[key] or (math.isnan(value) and math.isnan(row[key])), key


def test_report_judges_every_claim(smoke, tmp_path):
    out = tmp_path / "docs" / "results.md"
    assert main(["report", "--quick", str(smoke), "--out", str(out)]) == 0
    text = out.read_text()
    from experiments.claims import CLAIMS

    for claim in CLAIMS:
        assert claim.text in text
    assert "Do not edit by hand" in text and "not measured by this run" in text  # early_lstm absent
    # labelled by the config's name (smoke.yaml), though passed as --quick
    assert (tmp_path / "docs" / "results" / "smoke" / "ttft_cdf.png").is_file()
    assert "](results/smoke/ttft_cdf.png)" in text


def _write(tmp_path: Path, **changes) -> Path:
    config = {**yaml.safe_load(SMOKE.read_text()), "quality_reference": None, **changes}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"arms": ["vllm_fcfs", "no_such_arm"]}, "unknown arm 'no_such_arm'"),
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"seed": [0]}, "unknown key 'seed' (did you mean 'seeds'?)"),
        ({"arms": 5}, "key 'arms'"),
        ({"grid": {"workload.rate_scale": 2}}, "key 'grid.workload.rate_scale'"),
        ({"arms": [{"name": "x", "parent": "score", "set": {"preemption.treshold": 0.1}}]},
         "arm 'x': unknown config key 'preemption.treshold'"),
        ({"arms": [{"name": "x", "parent": "score", "set": {"preemption.threshold": "high"}}]},
         "arm 'x': config key 'preemption.threshold'"),
        ({"arms": [{"name": "x", "set": {"preemption.threshold": -1}}]},
         "arm 'x': config key 'preemption.threshold'"),
        ({"arms": ["early_oracle"]}, "arm 'early_oracle': reference arm 'swap_mixed' must be among"),
        ({"arms": [{"name": "x", "parent": "nope"}]}, "arm 'x': parent: unknown arm 'nope'; known arms"),
        ({"arms": [{"name": "x", "parent": "y"}, {"name": "y", "parent": "z"}]},
         "arm 'x': parent of 'y': unknown arm 'z'"),
        ({"arms": [{"name": "x", "parent": "y"}, {"name": "y", "parent": "x"}]},
         "arm 'x': parent cycle through 'x'"),
        ({"arms": ["score"], "quality_reference": "tiny_swap_zstd"}, "quality_reference 'tiny_swap_zstd'"),
        ({"base": {"cache": {"num_blocks": 0}}}, "base: config key 'cache.num_blocks'"),
    ],
)  # fmt: skip
def test_bad_ablation_config_fails_before_anything_runs(tmp_path, capsys, changes, expected):
    out = tmp_path / "out"
    assert main(["ablate", "--config", str(_write(tmp_path, **changes)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert err.count("arm 'x'") <= 1, err  # each name once
    assert not out.exists()


def test_bad_flags_fail_with_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", "--config", str(SMOKE), "--out", str(out), "--arms", "nope"]) == 2
    assert main(["ablate", "--config", str(SMOKE), "--out", str(out), "--predictor", "missing.ckpt"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "--arms: 'nope'" in errors[0] and "predictor checkpoint not found" in errors[1]
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["ablate", "--config", str(SMOKE), "--out", str(out), "--jobs", "0"])


def test_lstm_arm_without_a_predictor_is_skipped_with_a_note(tmp_path):
    path = _write(tmp_path, arms=["swap_mixed", "early_lstm"])
    plan = plan_ablation(path, tmp_path / "out")
    lstm = plan.run("early_lstm")
    assert "no predictor checkpoint" in lstm.skip_reason and plan.run("swap_mixed").skip_reason is None
    ckpt = tmp_path / "predictor.ckpt"
    ckpt.write_bytes(b"")
    lstm = plan_ablation(path, tmp_path / "out", predictor=str(ckpt)).run("early_lstm")
    assert lstm.skip_reason is None and lstm.config.early_save.checkpoint == str(ckpt)


def test_every_standard_arm_changes_something_and_resolves(tmp_path):
    path = _write(tmp_path, arms=list(STANDARD_ARMS))
    plan = plan_ablation(path, tmp_path / "out", predictor=None)
    configs = {run.key: run.config for run in plan.runs}
    for run in plan.runs:
        if run.parent:  # one piece at a time: the child differs from its parent
            assert configs[run.key] != configs[run.parent], run.key


def test_sweep_config_parameters_are_engine_keys(tmp_path):
    sweep = yaml.safe_load(Path("preempt/configs/sweep.yaml").read_text())
    assert sweep["metric"]["name"] in METRICS and sweep["program"] == "experiments/sweep.py"
    args = sweep["command"]
    ablation, arm = args[args.index("--ablation") + 1], args[args.index("--arm") + 1]
    finals = [f"{key}=0.5" for key in sweep["parameters"]]
    run = plan_ablation(ablation, tmp_path, only=[arm], final_overrides=finals).runs[0]
    assert run.config.preemption.threshold == 0.5 and run.config.preemption.priority_weights.age == 0.5


def test_sweep_program_runs_one_arm_with_the_agents_arguments(tmp_path, capsys):
    from experiments.sweep import main as sweep_main

    argv = ["--ablation", str(SMOKE), "--arm", "rate_limit", "--wandb", "disabled", "--out", str(tmp_path),
            "--preemption.threshold=0.3", "--preemption.priority_weights.age=0.1"]  # fmt: skip
    assert sweep_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["goodput_req_s"] > 0
    summary = json.loads((Path(result["run_dir"]) / "summary.json").read_text())
    assert summary["config"]["preemption"]["threshold"] == 0.3  # after the arm's own 0.2
    assert sweep_main([*argv[:-2], "--preemption.nope=1"]) == 2


def test_the_ablation_path_never_imports_lightning():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from experiments import ablate, aggregate, arms, derive, execution, plan, plots, report\n"
        "from experiments import sweep\n"
        "from preempt.obs import stats\n"
        "from preempt.cli import build_parser\n"
        "runs = plan.plan_ablation('preempt/configs/quick.yaml', '/tmp/x')\n"
        "assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_paper_grid_runs_every_arm_at_every_point_with_references_at_the_same_point(tmp_path):
    plan = plan_ablation("preempt/configs/paper.yaml", tmp_path, predictor=None)
    points = {tuple(sorted(run.grid_point.items())) for run in plan.runs}
    assert len(points) == 6 * 5 and len(plan.runs) == 6 * 5 * len(STANDARD_ARMS)  # 5 seeds per point
    oracle = plan.run("early_oracle@trace=azure-code,rate_scale=2.0,seed=3")
    assert oracle.reference == "swap_mixed@trace=azure-code,rate_scale=2.0,seed=3"
    assert oracle.config.workload.trace == "azure-code" and oracle.config.workload.rate_scale == 2.0
    assert oracle.config.seed == 3
    assert plan.run("early_lstm@trace=azure-conv,rate_scale=1.0,seed=0").skip_reason  # no predictor given


def test_the_headline_grid_runs_both_traces_in_ten_minute_windows_of_their_own(tmp_path):
    plan = plan_ablation("preempt/configs/headline.yaml", tmp_path, predictor=None)
    arms = {run.arm for run in plan.runs}
    assert {"uniboost", "vllm_lcf", "vllm_priority", "score_learned"} <= arms
    assert len(plan.runs) == 2 * 3 * 5 * len(arms)  # traces x loads x seeds
    windows = {
        (run.config.workload.trace, run.config.workload.start_s, run.config.workload.duration_s)
        for run in plan.runs
    }
    traces = ("azure-conv", "azure-code")
    assert windows == {(trace, 600.0 * seed, 600.0) for trace in traces for seed in range(5)}
    run = plan.run("uniboost@trace=azure-code,rate_scale=4.0,seed=2")
    assert (run.config.cache.num_blocks, run.config.scheduler.max_num_seqs) == (2000, 128)


def test_base_config_file_is_read_relative_to_the_ablation(tmp_path):
    (tmp_path / "serve.json").write_text('{"preemption": {"threshold": 0.3}, "cache": {"num_blocks": 900}}')
    path = _write(tmp_path, base_config="serve.json", arms=["vllm_fcfs", "rate_limit"])
    plan = plan_ablation(path, tmp_path / "out")
    assert plan.run("vllm_fcfs").config.preemption.threshold == 0.3
    assert plan.run("vllm_fcfs").config.cache.num_blocks == 600  # `base` wins over the file
