"""Plots and intervals of an ablation with seeds (three arms x two seeds of the smoke
workload): every summary.csv metric has its intended range and its interval stays in it;
the bars are the mean over seeds with 95% error bars; the CDFs and preemption counts
show every seed; without seeds the plots are those of one run per arm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from experiments import plots
from experiments.ablate import ablate
from experiments.arms import STANDARD_ARMS
from experiments.dominance import DESIGN_ARMS, is_baseline
from experiments.tables import read_csv
from preempt.obs.stats import NONNEGATIVE, UNIT, metric_range

SMOKE = Path("preempt/configs/smoke.yaml")
SEEDS = [0, 1]
ARMS = ["vllm_priority", "swap_mixed", "early_rule"]

# The intended range of every metric column a run produces (experiments/catalogue.py and
# the early-save engine's own `early_*` keys): a new column fails here until it is given one.
SHARES = """slo_attainment token_agreement exact_match_share early_save_precision
    early_save_recall stall_share""".split()
AMOUNTS = """goodput_req_s num_requests num_finished num_aborted ttft_p50_s ttft_p99_s tpot_p50_s
    tpot_p99_s num_preemptions num_priority_preemptions num_memory_preemptions num_reclaims
    peak_priority_preemptions_per_min num_preemption_failed num_restore_fallbacks
    preemption_stall_s preemption_stall_save_s preemption_stall_restore_s
    preemption_restore_wait_s stall_per_preemption_ms recomputed_tokens num_saves num_restores
    kv_bytes_moved kv_saved_bytes_raw kv_saved_bytes_stored stored_over_raw host_pool_peak_bytes
    save_ms_p50 save_ms_p99 restore_ms_p50 restore_ms_p99 num_early_saves early_bytes_raw
    early_bytes_used early_bytes_wasted sim_time_s early_save_selected""".split()
EXPECTED = {**{name: NONNEGATIVE for name in AMOUNTS}, **{name: UNIT for name in SHARES}}


def _expected(column: str) -> tuple[float, float]:
    base = column.split("_", 1)[1] if column.startswith("sla") and column[3:4].isdigit() else column
    return EXPECTED[base]


def _config(tmp: Path, seeds: list[int] | None) -> Path:
    config = yaml.safe_load(SMOKE.read_text())
    config = {"name": "plots-test", "base": config["base"], "arms": ARMS}
    if seeds:
        config["seeds"] = seeds
    path = tmp / f"plots-{len(seeds or [])}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _record_figures(recorded: dict[str, dict[str, Any]]):
    """plots._save that notes each figure's titles and lines before writing it."""
    save = plots._save

    def record(fig, path: Path) -> Path:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        recorded[path.name] = {
            "title": " ".join(
                [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in axes]
            ),
            "lines": [ax.get_lines() for ax in axes],
            "containers": [ax.containers for ax in axes],
        }
        return save(fig, path)

    return record


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plots")
    recorded: dict[str, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plots, "_save", _record_figures(recorded))
        result = ablate(_config(tmp, SEEDS), tmp / "out", wandb="disabled", jobs=1, log=lambda _: None)
    assert all(row["status"] == "ok" for row in result.rows)
    return tmp / "out", result, recorded


def test_every_summary_metric_has_its_intended_range_and_its_interval_stays_in_it(seeded):
    out, _, _ = seeded
    points = read_csv(out / "summary.csv")
    metrics = [c for c in points[0] if f"{c}_lo" in points[0]]
    assert "sla2_goodput_req_s" in metrics and "early_save_selected" in metrics
    for metric in metrics:
        lo, hi = _expected(metric)
        assert metric_range(metric) == (lo, hi), metric
        for row in points:
            mean, mlo, mhi = row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"]
            if not math.isnan(mlo):
                assert lo <= mlo <= mean <= mhi <= hi, (row["run"], metric, mlo, mean, mhi)
    # the seeds differ, so some intervals really were cut at 0 (a count of 0 or 2 events)
    clipped = [(r["run"], m) for r in points for m in metrics if r[f"{m}_lo"] == 0.0 < r[f"{m}_hi"]]
    assert clipped


def test_bars_are_the_mean_over_seeds_with_95_percent_error_bars(seeded):
    out, result, recorded = seeded
    goodput = recorded["goodput.png"]
    assert "mean and 95% interval over 2 seeds" in goodput["title"]
    (containers,) = goodput["containers"]
    bar = next(c for c in containers if type(c).__name__ == "BarContainer")
    errors = next(c for c in containers if type(c).__name__ == "ErrorbarContainer")
    by_run = {p["run"]: p for p in result.points}
    heights = [rect.get_height() for rect in bar]
    assert heights == pytest.approx([by_run[arm]["goodput_req_s"] for arm in ARMS])
    segments = errors.lines[2][0].get_segments()  # one vertical segment per bar: lo..hi
    ends = [v for segment in segments for v in segment[:, 1]]
    expected = [by_run[arm][f"goodput_req_s_{end}"] for arm in ARMS for end in ("lo", "hi")]
    assert ends == pytest.approx(expected)
    for name in ("stall_per_preemption.png", "bytes_saved.png", "early_save_precision_recall.png"):
        assert "mean and 95% interval over 2 seeds" in recorded[name]["title"], name
        assert (out / "plots" / name).stat().st_size > 5_000


def test_cdfs_and_preemption_counts_show_every_seed(seeded):
    _, _, recorded = seeded
    for name in ("ttft_cdf.png", "tpot_cdf.png"):
        figure = recorded[name]
        assert "pooled over seeds 0 1" in figure["title"] and "faint: each seed" in figure["title"]
        for lines in figure["lines"]:  # per SLA class: each arm's seeds (faint) and pooled (bold)
            assert len(lines) == len(ARMS) * (len(SEEDS) + 1)
            assert sorted(
                line.get_label() for line in lines if not line.get_label().startswith("_")
            ) == sorted(ARMS)
    over_time = recorded["preemptions_over_time.png"]
    assert "mean count over seeds 0 1" in over_time["title"]
    (lines,) = over_time["lines"]
    assert len(lines) == len(ARMS) * (len(SEEDS) + 1)


def test_without_seeds_one_run_per_arm_and_no_error_bars(tmp_path):
    recorded: dict[str, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plots, "_save", _record_figures(recorded))
        result = ablate(
            _config(tmp_path, None), tmp_path / "out", wandb="disabled", jobs=1, log=lambda _: None
        )
    assert result.points is None
    goodput = recorded["goodput.png"]
    assert "seed" not in goodput["title"]
    assert not [c for c in goodput["containers"][0] if type(c).__name__ == "ErrorbarContainer"]
    for lines in recorded["ttft_cdf.png"]["lines"]:
        assert len(lines) == len(ARMS)
    assert "seed" not in recorded["ttft_cdf.png"]["title"]


def test_a_sweep_panel_where_no_run_finished_is_drawn_empty(tmp_path):
    """A point whose runs all failed (a dead Ray worker) leaves NaN means: the panel says so
    instead of failing the log-scaled axis (and the whole ablation with it)."""
    import math

    from experiments.plots import sweep_lines

    points = [{"arm": "a", "link_gb_s": x, "goodput_req_s": math.nan} for x in (6.25, 25.0, 50.0)]
    path = sweep_lines(points, "link_gb_s", [("goodput_req_s", "goodput")], tmp_path / "p.png", "t")
    assert path.is_file()


# ------------------------------------------------ colours: the arms that matter, the rest grey

ALL_ARMS = [*DESIGN_ARMS, *(name for name in STANDARD_ARMS if name not in DESIGN_ARMS)]


def _is_highlighted(arm: str) -> bool:
    return arm in DESIGN_ARMS or is_baseline(arm)


def test_the_design_and_the_named_baselines_have_colours_the_other_arms_are_grey():
    styles = plots.arm_styles(ALL_ARMS)
    coloured = [arm for arm, style in styles.items() if style.is_highlighted]
    assert {"score", "score_tuned", "vllm_fcfs", "vllm_priority", "fastserve_mlfq"} <= set(coloured)
    assert sorted(coloured) == sorted(filter(_is_highlighted, ALL_ARMS))
    assert list(styles)[: len(coloured)] == coloured  # the legend's order: them first
    assert len({(styles[a].color, styles[a].linestyle) for a in coloured}) == len(coloured)
    assert all(styles[a].color in plots.PALETTE for a in coloured)
    grey = [style for style in styles.values() if not style.is_highlighted]
    assert "swap_mixed" not in coloured and len(grey) == len(ALL_ARMS) - len(coloured) > 0
    assert {style.color for style in grey} == {plots.GREY}
    assert all(style.linewidth < min(styles[a].linewidth for a in coloured) for style in grey)
    # one legend entry between them: the first says how many, the rest are hidden
    shown = [style.label("x") for style in grey if not style.label("x").startswith("_")]
    assert shown == [f"other arms ({len(grey)})"]


def test_an_arm_has_the_same_colour_in_every_figure():
    every = plots.arm_styles(ALL_ARMS)
    fewer = plots.arm_styles([a for a in ALL_ARMS if a not in ("score", "vllm_priority")])
    small = plots.arm_styles(["fastserve_mlfq", "early_rule", "vllm_fcfs"])
    for arm in ("vllm_fcfs", "fastserve_mlfq"):
        assert every[arm].color == fewer[arm].color == small[arm].color


def test_a_figure_with_few_arms_colours_them_all():
    styles = plots.arm_styles(["vllm_priority", "swap_mixed", "early_rule"])
    assert all(style.is_highlighted for style in styles.values())
    assert len({style.color for style in styles.values()}) == 3 and plots.GREY not in {
        style.color for style in styles.values()
    }


def _capture(monkeypatch) -> list[Any]:
    """The figures plots._save is given, before it writes (and closes) them."""
    figures: list[Any] = []
    save = plots._save

    def keep(fig, path: Path) -> Path:
        figures.append(
            {
                "legend": [t.get_text() for legend in fig.legends for t in legend.get_texts()],
                "lines": [
                    (line.get_label(), line.get_color(), line.get_linewidth())
                    for ax in fig.axes
                    for line in ax.get_lines()
                ],
                "size": tuple(fig.get_size_inches()),
            }
        )
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_a_sweep_colours_the_arms_that_matter_and_greys_the_rest(tmp_path, monkeypatch):
    figures = _capture(monkeypatch)
    points = [
        {"arm": arm, "rate_scale": x, "goodput_req_s": i + x, "goodput_req_s_lo": i, "goodput_req_s_hi": 99}
        for i, arm in enumerate(ALL_ARMS)
        for x in (0.5, 1.0, 2.0)
    ]
    metrics = [("goodput_req_s", "goodput"), ("goodput_req_s", "again"), ("goodput_req_s", "thrice")]
    plots.sweep_lines(points, "rate_scale", metrics, tmp_path / "sweep.png", "t")
    (figure,) = figures
    coloured = list(filter(_is_highlighted, ALL_ARMS))
    num_grey = len(ALL_ARMS) - len(coloured)
    assert sorted(figure["legend"]) == sorted([*coloured, f"other arms ({num_grey})"])
    assert figure["legend"][-1] == f"other arms ({num_grey})"
    for label, color, _ in figure["lines"]:
        arm = label.lstrip("_")
        if arm in coloured:
            assert color in plots.PALETTE, arm
        else:  # a grey arm's line carries the shared entry or a hidden one
            assert color == plots.GREY and (label.startswith("_") or label.startswith("other arms"))
    assert len(figure["lines"]) == 3 * len(ALL_ARMS)  # every arm drawn in every panel
    width, height = figure["size"]
    assert width <= 10.5 and height > 4  # three panels: two a row, not one long strip
