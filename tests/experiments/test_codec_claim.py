"""The codec budget claim on hand-made `preempt bench codec` results: the sensitivity plan
against uniform FP8 paired prompt by prompt, a verdict only when both intervals are clear
of 0, and `not measured` without per-prompt values or a codec result at all; the report
judges it from `--codec PATH`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.claims import BENCH_CLAIMS, HELD, INCONCLUSIVE, NOT_HELD, NOT_MEASURED
from preempt.cli import main
from tests.experiments.test_report import _ablation, claims_alike  # noqa: F401 (a fixture)

CLAIM = next(claim for claim in BENCH_CLAIMS if claim.key == "codec_budget")
FP8_AGREEMENT = [0.5, 0.4, 0.6, 0.5, 0.3, 0.7]
FP8_KL = [0.0030, 0.0025, 0.0028, 0.0031, 0.0026, 0.0029]


def _row(size: float, agreement: list[float], kl: list[float]) -> dict[str, Any]:
    return {
        "size_vs_fp16": size,
        "greedy_agreement": sum(agreement) / len(agreement),
        "kl_mean": sum(kl) / len(kl),
        "top1_agreement": 0.97,
        "per_prompt": {"greedy_agreement": agreement, "kl_mean": kl, "top1_agreement": [0.97] * len(kl)},
    }


def _result(agreement_gain: list[float], kl_gain: list[float], size: float = 0.348) -> dict[str, Any]:
    """fp8 and a sensitivity plan whose per-prompt values are fp8's plus the gains."""
    return {
        "model": "runs/lm/lm.pt",
        "budget": {"target_size_vs_fp16": 0.35},
        "plans": {
            "fp8": _row(0.5, FP8_AGREEMENT, FP8_KL),
            "budget_sensitivity": _row(
                size,
                [a + g for a, g in zip(FP8_AGREEMENT, agreement_gain, strict=True)],
                [k + g for k, g in zip(FP8_KL, kl_gain, strict=True)],
            ),
        },
    }


BETTER_AGREEMENT = [0.10, 0.12, 0.08, 0.11, 0.09, 0.10]  # clear of 0 whatever the prompt
LOWER_KL = [-0.0008, -0.0007, -0.0009, -0.0008, -0.0006, -0.0008]
NOISY = [0.2, -0.25, 0.15, -0.1, 0.05, -0.02]  # a mean near 0, a wide interval


def test_better_on_both_paired_by_prompt_holds():
    # prompts differ a lot from each other (fp8's agreement spans 0.3-0.7); the plan's gain
    # on each is steady, and the paired difference is what is judged
    finding = CLAIM.judge(_result(BETTER_AGREEMENT, LOWER_KL))
    assert finding.verdict == HELD
    assert "n=6 prompts" in finding.measured and "0.348x vs 0.500x" in finding.measured


def test_either_on_its_wrong_side_does_not_hold():
    worse_agreement = [-g for g in BETTER_AGREEMENT]
    assert CLAIM.judge(_result(worse_agreement, LOWER_KL)).verdict == NOT_HELD
    higher_kl = [-g for g in LOWER_KL]
    assert CLAIM.judge(_result(BETTER_AGREEMENT, higher_kl)).verdict == NOT_HELD
    # better quality over the budget is not the claim either
    assert CLAIM.judge(_result(BETTER_AGREEMENT, LOWER_KL, size=0.36)).verdict == NOT_HELD


def test_an_interval_across_0_is_inconclusive_whatever_the_means_say():
    result = _result(NOISY, LOWER_KL)
    plans = result["plans"]
    # the means alone say "better": the pairing shows it is within the prompts' spread
    assert plans["budget_sensitivity"]["greedy_agreement"] > plans["fp8"]["greedy_agreement"]
    finding = CLAIM.judge(result)
    assert finding.verdict == INCONCLUSIVE and "difference 0.005 [" in finding.measured


def test_without_a_codec_result_or_its_plans_it_is_not_measured():
    assert CLAIM.judge(None).verdict == NOT_MEASURED
    untrained = {"model": "random (untrained)", "plans": {"fp8": _row(0.5, FP8_AGREEMENT, FP8_KL)}}
    finding = CLAIM.judge(untrained)
    assert finding.verdict == NOT_MEASURED and "budget_sensitivity" in finding.measured
    old = _result(BETTER_AGREEMENT, LOWER_KL)
    for row in old["plans"].values():
        del row["per_prompt"]  # a JSON from before per-prompt values were kept
    assert CLAIM.judge(old).verdict == NOT_MEASURED


def _claims_section(text: str) -> str:
    lines = text.splitlines()
    start = lines.index("## Claims: benchmarks")
    return "\n".join(lines[start : lines.index("", start + 4)])


@pytest.mark.usefixtures("claims_alike")  # the ablation's claims not measured: only the codec's
def test_report_judges_the_codec_claim_from_the_codec_flag(tmp_path: Path, capsys):
    quick = _ablation(tmp_path / "quick", "quick", ("goodput",))
    codec = tmp_path / "codec.json"
    codec.write_text(json.dumps(_result(BETTER_AGREEMENT, LOWER_KL)))
    out = tmp_path / "report" / "results.md"
    assert main(["report", "--quick", str(quick), "--codec", str(codec), "--out", str(out)]) == 0
    text = out.read_text()
    assert f"--codec {codec}" in text  # the command that generated it
    assert f"| {CLAIM.text} | {CLAIM.source} | held |" in text  # beside the glance table
    assert "**held**" in _claims_section(text) and "n=6 prompts" in _claims_section(text)

    assert main(["report", "--quick", str(quick), "--out", str(out)]) == 0
    assert f"**{NOT_MEASURED}**" in _claims_section(out.read_text())

    capsys.readouterr()
    missing = ["--codec", str(tmp_path / "none.json"), "--out", str(out)]
    assert main(["report", "--quick", str(quick), *missing]) == 2
    assert "--codec" in capsys.readouterr().err


def test_the_report_command_takes_the_flag():
    from preempt.cli.parser import build_parser

    args = build_parser().parse_args(["report", "--quick", "q", "--codec", "c.json"])
    assert args.codec == Path("c.json")
    assert build_parser().parse_args(["report", "--quick", "q"]).codec is None


def test_the_main_job_measures_its_prompts_and_hands_them_to_the_report(tmp_path, monkeypatch):
    import preempt.bench.early_windows
    import preempt.cli.main_job as main_job

    steps: list[list[str]] = []

    def step(title: str, argv: list[str], stdout_to: Path | None = None) -> float:
        steps.append(argv)
        if stdout_to is not None:
            stdout_to.write_text("{}")
        return 0.0

    monkeypatch.setattr(main_job, "_step", step)
    monkeypatch.setattr(preempt.bench.early_windows, "render_windows", lambda result: "")
    main_job.run(tmp_path, tmp_path / "lm", "disabled")
    codec = next(argv for argv in steps if argv[:2] == ["bench", "codec"])
    assert codec[codec.index("--prompts") + 1] == str(main_job.CODEC_PROMPTS) == "32"
    report = next(argv for argv in steps if argv[0] == "report")
    assert report[report.index("--codec") + 1] == str(tmp_path / "codec.json")
