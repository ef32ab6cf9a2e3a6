"""experiments/main.py's plumbing: steps 3-4 as commands, run beside steps 1-2."""

from __future__ import annotations

from experiments.main import TRAIN_WINDOWS_START_S, _predictor_steps, _run_beside


def test_the_predictor_trains_on_what_the_collects_write(tmp_path):
    steps = _predictor_steps(tmp_path, "offline")
    assert [key for key, _, _ in steps] == ["collect"] * len(TRAIN_WINDOWS_START_S) + ["train"]
    written = [argv[argv.index("--features") + 1] for _, _, argv in steps[:-1]]
    train = steps[-1][2]
    assert train[train.index("--data") + 1].split(",") == written
    for start, (_, _, argv) in zip(TRAIN_WINDOWS_START_S, steps[:-1], strict=True):
        assert f"workload.start_s={start}" in argv


def test_a_failed_step_beside_stops_the_chain_and_names_itself(tmp_path):
    log = tmp_path / "steps.log"
    steps = [
        ("collect", "3/7 a step that fails", ["collect", "--no-such-flag"]),
        ("train", "4/7 never", ["train"]),
    ]
    thread, state = _run_beside(steps, log)
    thread.join(120)
    assert not thread.is_alive()
    assert "3/7 a step that fails" in state["error"] and str(log) in state["error"]
    assert "4/7 never" not in log.read_text() and "--no-such-flag" in log.read_text()
    assert state["times"] == {}
