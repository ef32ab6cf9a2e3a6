"""The leaderboard's Pareto plot: the design arms and the named baselines in their colours
with a legend entry each, every other arm grey under one shared entry per kind (front,
dominated), no names written over the points, the two panels one above the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.colors import to_hex

from experiments import plots
from experiments.arms import STANDARD_ARMS
from experiments.dominance import DESIGN_ARMS, is_baseline
from experiments.leaderboard import Ranking, pareto_plot

ALL_ARMS = [*DESIGN_ARMS, *(name for name in STANDARD_ARMS if name not in DESIGN_ARMS)]


def _ranking() -> Ranking:
    """Every arm at one point; every third one dominated by `score` (or by `vllm_fcfs`)."""
    summary: dict[str, dict[str, Any]] = {}
    beaten: dict[str, list[str]] = {}
    for i, arm in enumerate(ALL_ARMS):
        row: dict[str, Any] = {"arm": arm}
        values = {
            "goodput_req_s": 3.0 + 0.01 * i,
            "sla2_ttft_p99_s": 0.5 + 0.1 * i,
            "slo_attainment": 0.5 + 0.01 * i,
            "kv_bytes_moved": 1e9 * (i % 4),
        }
        for key, value in values.items():
            row[key], row[f"{key}_lo"], row[f"{key}_hi"] = value, 0.9 * value, 1.1 * value
        summary[arm] = row
        beaten[arm] = ([] if arm == "score" else ["score", "vllm_priority"]) if i % 3 == 2 else []
    beaten["score"] = ["vllm_fcfs"]  # a design arm dominated: hollow, and the legend says by whom
    return Ranking(summary, list(summary), beaten)


def test_the_pareto_plot_colours_the_arms_that_matter_and_names_them_in_its_legend(tmp_path, monkeypatch):
    figures: list[Any] = []
    save = plots._save

    def keep(fig, path: Path) -> Path:
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    ranking = _ranking()
    path = pareto_plot(ranking, tmp_path / "pareto.png", "point")
    assert path is not None and path.stat().st_size > 10_000
    (fig,) = figures
    coloured = [a for a in ALL_ARMS if a in DESIGN_ARMS or is_baseline(a)]
    grey = [a for a in ALL_ARMS if a not in coloured]
    assert "swap_mixed" in grey and "vllm_fcfs" in coloured

    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]

    def entry(arm: str) -> str:
        by = ranking.beaten[arm]
        return f"{arm} (dominated by {by[0]}{' +1' if len(by) == 2 else ''})" if by else arm

    assert labels == [*map(entry, coloured), "other arms, dominated", "other arms, front"]
    assert "score (dominated by vllm_fcfs)" in labels

    top, bottom = (ax for ax in fig.axes)
    assert top.get_position().y0 > bottom.get_position().y1  # stacked: each panel the full width
    for ax in (top, bottom):
        assert not ax.texts  # no labels printed over the points
        markers = [line for line in ax.get_lines() if line.get_marker() == "o"]
        colours = {to_hex(line.get_color()) for line in markers}
        assert to_hex(plots.GREY) in colours
        # one grey dot per grey arm; every other marker in a highlighted arm's colour
        assert sum(to_hex(line.get_color()) == to_hex(plots.GREY) for line in markers) == len(grey)
        assert colours - {to_hex(plots.GREY)} <= {to_hex(c) for c in plots.PALETTE}
