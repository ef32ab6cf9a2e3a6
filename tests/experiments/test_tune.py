"""`preempt tune`: the config's errors name their key before anything runs, a study writes
study.json and best.yaml with the parent's own values as trial 0, the same config gives
the same trials, and best.yaml is an arm an ablation config takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments.plan import ArmSpec, plan_ablation
from experiments.tune import _best, tune
from experiments.tune_config import load_tune_config, plan_tune, trial_overrides
from preempt.cli import main
from preempt.core.config import ConfigError

# A study in seconds: 10 s of the quick workload (null backend), two windows no ablation
# replays, three knobs.
TINY = {
    "name": "tiny_tuned",
    "base_config": "engine_quick.yaml",
    "base": {"workload": {"duration_s": 10}},
    "parent": "score",
    "space": {
        "preemption.threshold": {"low": 0.0, "high": 1.0},
        "preemption.priority_weights.age_cap_s": {"choices": [None, 2, 10]},
        "preemption.mode": {"choices": ["recompute", "pause"]},
    },
    "set_when": [{"when": {"preemption.mode": "pause"}, "set": {"preemption.async_restore": True}}],
    "seeds": [100, 101],
    "replicate": {"workload.start_s": [300, 900]},
    "objective": {"constraint": {"at_most_s": 1.0}},
    "trials": 3,
    "batch": 2,
}


def write(tmp_path: Path, **changes) -> Path:
    data = {**TINY, **changes}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_tune(config: Path, out: Path) -> dict:
    argv = ["tune", "--config", str(config), "--out", str(out), "--jobs", "1", "--wandb", "disabled"]
    assert main(argv) == 0
    return json.loads((out / "study.json").read_text())


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    return run_tune(write(root), root / "out"), root


SPACE = TINY["space"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trails": 3}, "unknown key 'trails'"),
        ({"objective": {"metric": "goodput", "constraint": None}}, "objective.metric 'goodput'"),
        ({"objective": {"metric": "wall_time_s"}}, "objective.metric 'wall_time_s'"),
        ({"space": {"preemption.threshold": {"low": 0, "high": 1, "lo": 0}}}, "unknown key 'lo'"),
        ({"space": {"preemption.threshold": {"low": 1, "high": 0}}}, "space 'preemption.threshold': low (1)"),
        ({"space": {"preemption.threshold": {"low": 0, "high": 1, "log": True}}}, "log needs low > 0"),
        ({"space": {"preemption.threshold": [0, 1]}}, "space 'preemption.threshold': expected"),
        ({"space": {"preemption.threshold": {"choices": []}}}, "space 'preemption.threshold'"),
        ({"space": {"preemption.nope": {"low": 0, "high": 1}}}, "space 'preemption.nope'"),
        ({"space": {"preemption.threshold": {"low": -1, "high": 1}}}, "space 'preemption.threshold': -1"),
        ({"space": {"preemption.mode": {"choices": ["recompute", "teleport"]}}}, "space 'preemption.mode'"),
        ({"space": {"preemption.threshold": {"low": 0.5, "high": 1}}}, "outside the space"),
        ({"space": {"workload.rate_scale": {"low": 1, "high": 2}}}, "space 'workload.rate_scale'"),
        (
            {"set_when": [{"when": {"preemption.slice_mode": "quantum"}, "set": {"seed": 1}}]},
            "set_when[0]: when 'preemption.slice_mode'",
        ),
        ({"name": "score"}, "name 'score'"),
        ({"parent": "no_such_arm"}, "unknown arm 'no_such_arm'"),
        ({"replicate": {"workload.start_s": [300]}}, "replicate 'workload.start_s'"),
        # [610, 620) s is inside load.yaml's second minute, [600, 660) s
        ({"replicate": {"workload.start_s": [610, 900]}}, "'workload.start_s': training window [610, 620)"),
    ],
)  # fmt: skip
def test_bad_configs_fail_before_anything_runs_naming_the_key(tmp_path, changes, message):
    with pytest.raises(ConfigError) as err:
        plan_tune(write(tmp_path, **changes))
    assert message in str(err.value), str(err.value)
    assert str(tmp_path / "tune.yaml") in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_shipped_config_is_valid_and_its_windows_avoid_the_judge():
    plan = plan_tune("preempt/configs/tune.yaml")
    assert len(plan.parent_runs) == 9
    # nor the early-save benchmark's held-out windows (200 s each)
    from preempt.bench.early_windows import HELD_OUT_WINDOWS_S

    for start in plan.config.replicate["workload.start_s"]:
        assert all(start + 60 <= s or start >= s + 200 for s in HELD_OUT_WINDOWS_S), start
    assert (plan.objective, plan.constraint, plan.at_most) == ("goodput_req_s", "sla2_ttft_p99_s", 1.0)
    assert plan.default == {  # the parent `score` on engine_quick.yaml
        "preemption.priority_weights.age": 0.05,
        "preemption.priority_weights.sla": 0.8,
        "preemption.priority_weights.tokens": 0.5,
        "preemption.priority_weights.age_cap_s": None,
        "preemption.threshold": 0.2,
        "preemption.time_slice_strategy": "static",
        "preemption.slice_mode": "gate",
        "preemption.max_preemption_per_min": None,
        "preemption.mode": "recompute",
        "preemption.remaining": "max_tokens",
    }
    held = {w["start_s"] for w in plan.windows if w["config"] == "load.yaml"}
    assert held == {0, 600, 1200, 1800, 2400}


def test_the_tuning_never_sees_azure_code_which_the_headline_judges_the_tuned_arms_on(tmp_path):
    """headline.yaml replays both traces; the tuned arms were tuned on azure-conv minutes
    (two of them inside its azure-conv windows), so azure-code is their held-out judge."""
    from experiments.plan import plan_ablation

    plan = plan_tune("preempt/configs/tune.yaml")
    training = [w for w in plan.windows if w["config"] == "training"]
    assert training and {w["trace"] for w in training} == {"azure-conv"}
    headline = plan_ablation("preempt/configs/headline.yaml", tmp_path)
    judged = {
        (r.config.workload.trace, r.config.workload.start_s) for r in headline.runs if r.arm == "score_tuned"
    }
    inside = {
        (trace, start)
        for trace, start in judged
        for w in training
        if trace == w["trace"] and w["start_s"] < start + 600 and start < w["end_s"]
    }
    assert inside == {("azure-conv", 0.0), ("azure-conv", 600.0)}  # what headline.yaml says


def test_a_pause_trial_restores_asynchronously_as_the_pause_arm(tmp_path):
    config = load_tune_config(write(tmp_path))
    assert trial_overrides(config, {"preemption.mode": "pause"})["preemption.async_restore"] is True
    assert "preemption.async_restore" not in trial_overrides(config, {"preemption.mode": "recompute"})


def test_a_study_writes_every_trial_with_the_default_as_trial_0(study):
    data, root = study
    trials = data["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2]
    assert all(t["state"] == "complete" for t in trials), [t.get("error") for t in trials]
    first = trials[0]
    assert first["default"] and first["params"] == {
        "preemption.threshold": 0.2,
        "preemption.priority_weights.age_cap_s": None,
        "preemption.mode": "recompute",
    }
    # trial 0 is the parent itself: its runs' configs are the `score` arm's exactly
    parent = plan_ablation(_ablation_of(root, "score"), root / "parent")
    arms = root / "out" / "trials" / "000" / "arms"
    ran = {
        key.split("@")[1]: json.loads((arms / key / "metrics.json").read_text())["config"]
        for key in first["runs"]
    }
    assert ran == {run.key.split("@")[1]: run.config.model_dump(mode="json") for run in parent.runs}
    for t in trials:
        runs = t["runs"].values()
        assert len(runs) == 2 and all(r["status"] == "ok" for r in runs)
        mean = sum(r["metrics"]["goodput_req_s"] for r in runs) / 2
        assert t["objective"] == pytest.approx(mean)
        ttft = sum(r["metrics"]["sla2_ttft_p99_s"] for r in runs) / 2
        assert t["constraint"] == pytest.approx(ttft) and t["feasible"] == (ttft <= 1.0)
        assert t["wall_s"] == pytest.approx(sum(r["metrics"]["wall_time_s"] for r in runs))
    assert data["cost"]["runs"] == 6 and data["cost"]["cpu_hours"] > 0 and data["cost"]["wall_s"] > 0
    assert data["best"] == _best(trials, "maximize")["number"]
    best = yaml.safe_load((root / "out" / "best.yaml").read_text())
    assert best["set"] == trials[data["best"]]["set"] and best["parent"] == "score"
    assert f"trial {data['best']}" in best["doc"] and "goodput_req_s" in best["doc"]


def _ablation_of(root: Path, *arms) -> Path:
    path = root / f"ablation-{len(list(root.glob('ablation-*')))}.yaml"
    data = {
        "name": "check",
        "base_config": "engine_quick.yaml",
        "base": TINY["base"],
        "seeds": TINY["seeds"],
        "replicate": TINY["replicate"],
        "arms": list(arms),
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_best_yaml_is_an_arm_an_ablation_config_takes(study):
    _, root = study
    spec = ArmSpec.model_validate(yaml.safe_load((root / "out" / "best.yaml").read_text()))
    assert spec.name == "tiny_tuned"
    plan = plan_ablation(_ablation_of(root, "score", spec.model_dump()), root / "check")
    tuned = [run for run in plan.runs if run.arm == "tiny_tuned"]
    assert len(tuned) == 2 and all(run.parent and run.parent.startswith("score@") for run in tuned)
    assert tuned[0].config.preemption.threshold == spec.set["preemption.threshold"]


def test_the_same_config_gives_the_same_trials(study, tmp_path):
    data, root = study
    again = tune(write(root), tmp_path / "again", jobs=1, wandb="disabled", log=lambda line: None)
    keys = ("number", "params", "set", "objective", "constraint", "feasible")
    same = [{k: t[k] for k in keys} for t in data["trials"]]
    assert [{k: t[k] for k in keys} for t in again.trials] == same
    assert again.summary["best"]["number"] == data["best"]


def test_no_feasible_trial_gives_the_least_infeasible_flagged(tmp_path, capsys):
    config = write(tmp_path, objective={"constraint": {"at_most_s": 1e-6}}, trials=2)
    argv = ["tune", "--config", str(config), "--out", str(tmp_path / "out"), "--jobs", "1"]
    assert main([*argv, "--wandb", "disabled"]) == 0
    summary = json.loads(capsys.readouterr().out)  # one JSON line on stdout
    assert summary["trials"] == 2 and summary["feasible"] == 0 and summary["best"]["feasible"] is False
    text = (tmp_path / "out" / "best.yaml").read_text()
    assert "# INFEASIBLE" in text and "INFEASIBLE" in yaml.safe_load(text)["doc"]
    trials = json.loads((tmp_path / "out" / "study.json").read_text())["trials"]
    least = min(trials, key=lambda t: t["constraint"])
    assert summary["best"]["number"] == least["number"]


def test_best_prefers_feasible_then_value_then_the_earlier_trial():
    def row(n, objective, violation, state="complete"):
        return {"number": n, "state": state, "objective": objective, "constraint_violation": violation,
                "feasible": None if state != "complete" else violation <= 0}  # fmt: skip

    rows = [row(0, 5.0, 0.1), row(1, 3.0, -0.1), row(2, 3.0, 0.0), row(3, 9.0, None, "failed")]
    assert _best(rows, "maximize")["number"] == 1
    assert _best(rows[:1], "maximize")["number"] == 0  # none feasible: flagged by the caller
    assert _best([row(0, 1.0, 0.5), row(1, 2.0, 0.2)], "minimize")["number"] == 1
    assert _best(rows[3:], "maximize") is None


def test_a_bad_config_through_the_cli_names_the_key(tmp_path, capsys):
    config = write(tmp_path, space={"preemption.nope": {"low": 0, "high": 1}})
    assert main(["tune", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "space 'preemption.nope'" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_through_ray_a_batch_gives_the_trials_it_gives_in_process(study, tmp_path):
    """--jobs 2: the batch's trials run side by side as Ray tasks (--ray-address takes the
    same path to a cluster); the study is the in-process one."""
    data, root = study
    ray = tune(write(root), tmp_path / "ray", trials=2, jobs=2, wandb="disabled", log=lambda line: None)
    keys = ("number", "params", "objective", "constraint")
    assert [{k: t[k] for k in keys} for t in ray.trials] == [
        {k: t[k] for k in keys} for t in data["trials"][:2]
    ]
    assert ray.summary["held_cpu_hours"] > 0
    assert sorted(p.name for p in (tmp_path / "ray" / "trials").iterdir()) == ["000", "001"]


def test_the_tuned_arm_is_the_committed_best_trial():
    """`score_tuned` (experiments/arms.py) is the study's best trial as the benchmark recorded
    it: the arm cannot drift from the search that produced it."""
    import json
    from pathlib import Path

    from experiments.arms import STANDARD_ARMS
    from experiments.plan import chain_overrides

    [study] = sorted(Path("benchmarks").glob("tune_*.json"))[-1:]
    data = json.loads(study.read_text())
    best = next(trial for trial in data["trials"] if trial["number"] == data["best"])
    arm = STANDARD_ARMS["score_tuned"]
    assert arm.parent == "score" and dict(arm.set) == best["set"] and best["feasible"]
    assert dict(chain_overrides("score_tuned"))["scheduler.policy"] == "priority_score"
