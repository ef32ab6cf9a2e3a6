"""The main job (`make run`): every piece of the framework, end to end, on embedded defaults.

1. `preempt lm train`: the reference LM on the Python stdlib (cached: trained once).
2. `preempt importance`: gradient head importance -> a mixed-precision head plan.
3. `preempt collect`: scheduling features + preemption labels from a replay.
4. `preempt train`: the LSTM preemption predictor (Lightning, wandb offline).
5. `preempt ablate`: the `quick` matrix (baselines, the design's pieces one at a time,
   early saves with the trained predictor; the tiny arms run the trained LM with the
   importance plan), wandb runs, results table, plots.
6. `preempt bench codec`: the mixed-precision codec per plan on the trained LM.
7. `preempt report`: claims vs measurements, from this run.

Thin on purpose: each step is the documented CLI command (printed before it runs), so a
user can rerun any one of them alone. Step 1 reuses `--lm` (runs/lm) when it holds an LM
of the same training config; every other step reruns.

    python -m experiments.main [--out runs/main] [--wandb offline]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path

from preempt.cli import main as preempt


def _step(title: str, argv: list[str], stdout_to: Path | None = None) -> float:
    print(
        f"\n== {title}\n$ preempt {shlex.join(argv)}" + (f" > {stdout_to}" if stdout_to else ""), flush=True
    )
    started = time.perf_counter()
    if stdout_to is None:
        code = preempt(argv)
    else:
        with open(stdout_to, "w") as out, contextlib.redirect_stdout(out):
            code = preempt(argv)
    if code:
        raise SystemExit(f"main job: step '{title}' failed (exit {code})")
    elapsed = time.perf_counter() - started
    print(f"-- {title}: {elapsed:.0f} s", flush=True)
    return elapsed


TRAIN_WINDOW_START_S = 3000  # azure-conv is 3,502 s long; collect.yaml replays 200 s


def run(out: Path, lm: Path, wandb: str) -> dict[str, float]:
    plan = lm / "importance_plan.json"
    times = {
        "lm": _step(
            "1/7 train the reference LM (cached)", ["lm", "train", "--out", str(lm), "--wandb", wandb]
        ),
        "importance": _step(
            "2/7 head importance -> plan",
            ["importance", "--model", str(lm / "lm.pt"), "--out", str(plan)],
            stdout_to=out / "importance.json",
        ),
        "collect": _step(
            "3/7 collect features",
            [
                "collect",
                "--config",
                "experiments/configs/collect.yaml",
                "--out",
                str(out / "collect"),
                "--features",
                str(out / "features"),
                "--no-progress",
                # Trained on a window no ablation replays (quick: 0-60 s; the sweeps: a
                # minute from 0, 600, ..., 2400 s), so `early_lstm` is judged out of sample.
                "--set",
                f"workload.start_s={TRAIN_WINDOW_START_S}",
            ],
        ),
        "train": _step(
            "4/7 train the predictor",
            ["train", "--data", str(out / "features"), "--out", str(out / "predictor"), "--wandb", wandb],
        ),
    }
    times["ablate"] = _step(
        "5/7 ablation (quick)",
        [
            "ablate",
            "--config",
            "experiments/configs/quick.yaml",
            "--out",
            str(out / "ablate"),
            "--predictor",
            str(out / "predictor" / "predictor.ckpt"),
            "--wandb",
            wandb,
            "--set",
            f"model.checkpoint={lm / 'lm.pt'}",
            "--set",
            f"preemption.head_plan={plan}",
        ],
    )
    times["codec"] = _step(
        "6/7 codec quality per plan",
        # quality per plan; the served-shape speed section (minutes) is the bench's own
        ["bench", "codec", "--json", "--model", str(lm / "lm.pt"), "--plan", str(plan), "--no-served-speed"],
        stdout_to=out / "codec.json",
    )
    times["report"] = _step(
        "7/7 report", ["report", "--quick", str(out / "ablate"), "--out", str(out / "results.md")]
    )
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.main", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/main"))
    parser.add_argument(
        "--lm", type=Path, default=Path("runs/lm"), help="the reference LM's folder (reused when up to date)"
    )
    parser.add_argument("--wandb", choices=["online", "offline", "disabled"], default="offline")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    times = run(args.out, args.lm, args.wandb)
    total = time.perf_counter() - started
    (args.out / "main_times.json").write_text(json.dumps({**times, "total": total}, indent=2) + "\n")
    print(
        f"\nmain job done in {total / 60:.1f} min ({', '.join(f'{k} {v:.0f} s' for k, v in times.items())})"
    )
    print(f"  ablation table : {args.out / 'ablate' / 'results.md'}")
    print(f"  plots          : {args.out / 'ablate' / 'plots'}/")
    print(f"  claims report  : {args.out / 'results.md'}")
    print(f"  codec per plan : {args.out / 'codec.json'}")
    print(f"  wandb (offline): wandb sync {args.out}/ablate/wandb/offline-run-*  (and {args.out}/predictor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
