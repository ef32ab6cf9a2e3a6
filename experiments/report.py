"""The results page from ablation outputs: `preempt report --quick DIR [--paper DIR2] [--out F]`
(F: runs/report/results.md; the published page is docs/results.md, `make results`).

Owns: the generated report: the claims at a glance, one claims table per source and grid
point (measured value, verdict; the claims themselves and how each is measured are
experiments.claims'), the results tables and the plots, copied next to the report.
Everything in it comes from `results.csv` and `ablation.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import headline as headline_section
from experiments.claims import (
    BENCH_CLAIMS,
    CLAIMS,
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    Arms,
    BenchClaim,
    Claim,
    Finding,
    design_claims,
    is_nan,
)
from experiments.dominance import DESIGN_ARMS, is_baseline
from experiments.leaderboard import leaderboard_markdown, where_to_run
from experiments.multiplicity import adjust
from experiments.tables import (
    MD_COLUMNS,
    interval_table,
    length_regime,
    markdown_table,
    read_csv,
    sla_interval_table,
    sla_table,
)
from preempt.core.config import upgrade_config


@dataclass(frozen=True)
class Source:
    label: str
    path: Path
    info: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]] | None = None  # summary.csv: points with intervals (seeds)

    @classmethod
    def load(cls, flag: str, path: str | Path, taken: Sequence[str] = ()) -> Source:
        """The ablation in `path` (passed as `--flag`), labelled by its config's name (its
        ablation.json, `preempt ablate`'s), else by `flag`; a label in `taken` gets the
        directory's name after it."""
        path = Path(path)
        for name in ("results.csv", "ablation.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"--{flag}: {path / name} not found (run `preempt ablate` first)")
        info = json.loads((path / "ablation.json").read_text())
        label = str(info.get("name") or flag)
        if label in taken:
            label = f"{label}-{path.name}"
        configs = {run["run"]: run["config"] for run in info["runs"]}
        rows = read_csv(path / "results.csv")
        for row in rows:
            row["_config"] = upgrade_config(configs[row["run"]])  # runs stored before a key moved
            for key in ("notes", "quality_note", "parent"):
                row[key] = "" if is_nan(row.get(key)) else row.get(key, "")
        summary = read_csv(path / "summary.csv") if (path / "summary.csv").is_file() else None
        return cls(label, path, info, rows, summary)

    def plots(self) -> list[Path]:
        """The plots the report shows for this ablation (the rest stay in its run directory)."""
        # A sweep's per-point plots (CDFs, bars: ~25 a point) stay in its run directory; the
        # report shows the lines against its axis, with bands. A grid of several axes has one
        # such plot per combination of the others (48 for regimes.yaml): those stay too, and
        # its table (docs/regimes.md) is the summary.
        grid = self.info.get("grid") or {}
        axes = [key for key, values in grid.items() if len(values) > 1]
        pattern = "*.png" if not grid else "sweep_*.png" if len(axes) <= 1 else None
        return sorted((self.path / "plots").glob(pattern)) if pattern else []

    def points(self) -> list[tuple[str, Arms, list[dict[str, Any]], list[dict[str, Any]] | None]]:
        """(grid point label, arm -> its rows over seeds, rows, summary rows or None) per
        grid point (seeds are replicates of a point, not points), in run order."""
        columns = [key.rsplit(".", 1)[-1] for key in self.info.get("grid", {})]

        def label_of(row: dict[str, Any]) -> str:
            return ", ".join(f"{c}={row[c]}" for c in columns)

        groups: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows:
            groups.setdefault(label_of(row), []).append(row)
        summary: dict[str, list[dict[str, Any]]] = {}
        for row in self.summary or []:
            summary.setdefault(label_of(row), []).append(row)
        out = []
        for label, rows in groups.items():
            arms: Arms = {}
            for row in rows:
                arms.setdefault(row["arm"], []).append(row)
            out.append((label, arms, rows, summary.get(label) if self.summary is not None else None))
        return out


def _copy_plots(source: Source, images_dir: Path, link_base: Path) -> list[tuple[str, str]]:
    plots = source.plots()
    target = images_dir / source.label
    if target.exists():
        shutil.rmtree(target)  # stale plots of an earlier report must not linger
    if plots:
        target.mkdir(parents=True, exist_ok=True)
    links = []
    for plot in plots:
        shutil.copy2(plot, target / plot.name)
        links.append((plot.stem, str((target / plot.name).relative_to(link_base))))
    return links


def render(
    sources: list[Source],
    out: Path,
    command: str,
    claims: list[Claim] = CLAIMS,
    design_arms: tuple[str, ...] = DESIGN_ARMS,
    bench: Sequence[tuple[BenchClaim, Finding]] = (),
    headline: Source | None = None,
    multiplicity: str = "bh",
    leaderboard: str = "leaderboard.md",
) -> str:
    """The report's text. `bench`: claims judged from benchmarks' JSON, with their findings
    (`judge_benchmarks`): one verdict each, beside the ablations' glance table and in a
    section of their own. `headline`: the headline ablation (preempt/configs/headline.yaml),
    which opens the page (experiments.headline). `multiplicity`: the correction over the
    family of the report's verdicts (experiments.multiplicity: "bh", "holm" or "none")."""
    verdicts: dict[str, dict[str, Finding]] = {}
    columns: list[str] = []
    regimes: list[tuple[str, Arms]] = []
    family = {}
    for source in sources:
        for label, arms, _, _ in source.points():
            column = source.label + (f" ({label})" if label else "")
            columns.append(column)
            if any(is_baseline(a) for a in arms) and any(d in arms for d in design_arms):
                regimes.append((column, arms))
            for claim in claims:
                verdicts.setdefault(claim.key, {})[column] = claim.evaluate(arms)
                family[(claim.key, column)] = lambda c=claim, a=arms: c.evaluate(a).verdict
    points = _headline_points(headline) if headline is not None else []
    family.update(headline_section.judges(points))
    adjusted = adjust(family, multiplicity)
    changed = [key for key in adjusted.changed if key[0] in verdicts]
    for key, column in changed:
        finding = verdicts[key][column]
        verdicts[key][column] = Finding(
            f"{finding.measured} ({finding.verdict} at 95% alone, not after the correction)",
            adjusted.verdicts[(key, column)],
        )
    by_source = {
        s.label: [c for c in columns if c == s.label or c.startswith(s.label + " (")] for s in sources
    }
    images_dir = out.parent / out.stem
    links = {source.label: _copy_plots(source, images_dir, out.parent) for source in sources}

    regimes_said = {}
    for source in sources:
        regimes_said.setdefault(length_regime(source.rows), []).append(f"`{source.label}`")
    lines = [
        "# Results",
        "",
        "Every claim of the design and of the field against what was measured, with 95% "
        "intervals over seeds; the method and every number below.",
        "",
    ]
    if headline is not None:
        where = (
            f"`{headline.info['source']}`: {len(headline.rows)} runs (seeds {headline.info.get('seeds')}) in "
            f"{headline.info.get('wall_s', 0):.0f} s wall with {headline.info.get('jobs')} jobs, "
            f"`{headline.path}` (commit `{headline.info.get('git_rev', '?')}`). "
            + headline.info.get("description", "").strip()
            + f" Lengths: {length_regime(headline.rows)}."
        )
        lines += headline_section.section(
            points, adjusted.verdicts, adjusted.describe(), where, adjusted.per_verdict
        )
    lines += [
        *_main_figure(links),
        "What each policy was told of a request's length (`workload.max_tokens_mode`; arms "
        "named `*_oracle` are told the true output length, an upper bound): "
        + "; ".join(f"{', '.join(labels)}: {regime}" for regime, labels in regimes_said.items())
        + ".",
        "",
        "## Claims at a glance",
        "",
        "| claim | source | " + " | ".join(by_source) + " | where its mechanism binds |",
        "| --- | --- | " + " | ".join("---" for _ in by_source) + " | --- |",
    ]
    for claim in claims:
        cells = [glance([verdicts[claim.key][c].verdict for c in cols]) for cols in by_source.values()]
        regime = claim.regime or "–"
        lines.append(f"| {claim.text} | {claim.source} | " + " | ".join(cells) + f" | {regime} |")
    if bench:
        lines += ["", "Judged from a benchmark's JSON (one verdict per report):", ""]
        lines += ["| claim | source | verdict |", "| --- | --- | --- |"]
        lines += [f"| {claim.text} | {claim.source} | {finding.verdict} |" for claim, finding in bench]
    lines += [
        "",
        "How to read it. Generated by `"
        + command
        + "` from "
        + ", ".join(f"`{s.path}` (commit `{s.info.get('git_rev', '?')}`)" for s in sources)
        + ". Do not edit by hand: rerun the ablations and this command. Every number the article "
        "claims is a hypothesis here; each row says what we measured and whether it held. "
        "Values are means over seeds with 95% intervals `[lo, hi]` (Student t, clipped to the "
        "metric's range: a share to [0, 1], a time, count or rate to [0, inf), a relative change "
        "`a / b - 1` to [-100%, inf), a reduction `1 - a / b` to (-inf, 100%]; differences between "
        "arms are paired by seed, in the metric's units, and not clipped; a ratio of two paired means "
        "has Fieller's interval, shown only where it is bounded); a claim is `held` or "
        "`did not hold` only when the "
        "interval lies on one side of its bound, otherwise `inconclusive` with the interval; "
        "`idle` where the mechanism never acted at that point (no priority preemption, a cap never "
        "reached, a slice that never decided: no evidence either way). In the glance table `–` "
        "marks a sweep without the arms a claim needs. Multiplicity: "
        + adjusted.describe()
        + (
            "; the claims' verdicts it changed are listed in [its own section](#multiplicity)."
            if changed
            else "; it changed no claim's verdict."
        ),
        "",
    ]
    lines += [
        "## What to run where",
        "",
        f"Per regime (a sweep point), from the leaderboard ([{leaderboard}]({leaderboard}), beside "
        "this report: every policy's numbers and Pareto plot at every point): the arms no other "
        "arm dominates (paired 95% intervals on goodput, the top class's TTFT p99 and the top "
        "class's SLO attainment: TTFT alone would credit a policy that starves the top class's "
        "decode), the best arm per objective with the arms its paired interval cannot tell from "
        "it, and each design arm's paired difference to that best per objective (`worse`: the "
        "interval excludes 0 on the bad side).",
        "",
        where_to_run(regimes, design_arms),
        "",
    ]
    multi_point = {c for cols in by_source.values() if len(cols) > 1 for c in cols}
    for column in columns:
        # Each point's table lists the claims it measured; a single ablation names the rest
        # after it in one line (a sweep's points leave them to the glance table).
        shown = [c for c in claims if verdicts[c.key][column].verdict != NOT_MEASURED]
        absent = [c for c in claims if verdicts[c.key][column].verdict == NOT_MEASURED]
        if not shown:
            continue
        lines += [
            f"## Claims: {column}",
            "",
            "| claim | how measured | measured | verdict |",
            "| --- | --- | --- | --- |",
        ]
        for claim in shown:
            finding = verdicts[claim.key][column]
            measured = finding.measured.replace("|", "\\|")
            lines.append(
                f"| {claim.text} ({claim.source}) | {claim.method} | {measured} | **{finding.verdict}** |"
            )
        if absent and column not in multi_point:
            lines += ["", "Not measured by this run (the arms they need did not run): "
                      + "; ".join(claim.text for claim in absent) + "."]  # fmt: skip
        lines.append("")

    if bench:
        lines += [
            "## Claims: benchmarks",
            "",
            "| claim | how measured | measured | verdict |",
            "| --- | --- | --- | --- |",
        ]
        for claim, finding in bench:
            measured = finding.measured.replace("|", "\\|")
            lines.append(
                f"| {claim.text} ({claim.source}) | {claim.method} | {measured} | **{finding.verdict}** |"
            )
        lines.append("")

    for source in sources:
        info = source.info
        lines += [
            f"## Ablation `{info['name']}` ({source.label})",
            "",
            info.get("description", "").strip(),
            "",
            f"`{info['source']}`: {len(source.rows)} runs (seeds {info.get('seeds') or 'one'}) in "
            f"{info.get('wall_s', 0):.0f} s wall with {info.get('jobs')} jobs"
            f"{' on Ray at ' + info['ray_address'] if info.get('ray_address') else ''}; "
            f"wandb {info.get('wandb')}; "
            f"predictor {info.get('predictor') or 'none'}. Lengths: {length_regime(source.rows)}.",
            "",
        ]
        for label, _, rows, points in source.points():
            if label:
                lines += [f"### {label}", ""]
            if points is not None:
                lines += [interval_table(points), "", "Per SLA class (higher = more important):", ""]
                lines += [sla_interval_table(points), ""]
                continue
            lines += [markdown_table(rows, MD_COLUMNS), "", "Per SLA class (higher = more important):", ""]
            lines += [sla_table(rows), ""]
        notes = [(r["run"], r["notes"]) for r in source.rows if r.get("notes")]
        if notes:
            lines += ["Notes:", ""] + [f"- `{run}`: {note}" for run, note in notes] + [""]
        if links[source.label]:
            lines += ["Plots:", ""] + [f"![{stem}]({link})" for stem, link in links[source.label]] + [""]
        else:
            lines += [
                f"Plots: `{source.path}/plots/` (not copied: one per combination of the grid's axes).",
                "",
            ]
    if changed:
        lines += [
            "## Multiplicity",
            "",
            adjusted.describe()[0].upper()
            + adjusted.describe()[1:]
            + ". The claims whose verdict it changed "
            "(decisive at 95% alone, inconclusive in the family):",
            "",
        ]
        lines += [f"- {column}: {_claim_text(claims, key)}" for key, column in changed]
        lines.append("")
    lines += _main_job_times(sources)
    return "\n".join(lines)


def _claim_text(claims: Sequence[Claim], key: str) -> str:
    return next((claim.text for claim in claims if claim.key == key), key)


def _headline_points(source: Source) -> list[headline_section.Point]:
    docs = {run["arm"]: run.get("doc", "") for run in source.info["runs"]}
    return [
        headline_section.Point(label, arms, {row["arm"]: row for row in summary or []}, docs)
        for label, arms, _, summary in source.points()
    ]


def _main_job_times(sources: list[Source]) -> list[str]:
    """The main job's steps and their times, when an ablation came from one (`make run`
    writes main_times.json beside its ablation)."""
    for source in sources:
        path = source.path.parent / "main_times.json"
        if path.is_file():
            times = json.loads(path.read_text())
            total = times.pop("total", sum(times.values()))
            steps = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items())
            return [
                "## How long the main job took",
                "",
                f"`make run` ({path}): {total / 60:.1f} min on this machine after the install: {steps}. "
                "The reference LM is cached in runs/lm after its first training.",
                "",
            ]
    return []


def judge_benchmarks(paths: dict[str, str | Path | None]) -> list[tuple[BenchClaim, Finding]]:
    """Every benchmark claim with its finding from the JSON at `paths[name]` (`codec`: the
    `--codec` file); a benchmark without a path is not measured."""
    results = {}
    for name, path in paths.items():
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--{name}: {path} not found (`preempt bench {name} --json > FILE`)")
            results[name] = json.loads(Path(path).read_text())
    return [(claim, claim.judge(results.get(claim.bench))) for claim in BENCH_CLAIMS]


def _main_figure(links: dict[str, list[tuple[str, str]]]) -> list[str]:
    """The report's one figure on its first screen, with its caption: the load sweep's
    goodput against load, else the first sweep's goodput plot, else an ablation's goodput
    bars, else its first plot; no lines when no plot was copied."""
    figures = [(label, stem, link) for label, plots in links.items() for stem, link in plots]

    def rank(figure: tuple[str, str, str]) -> int:
        label, stem, _ = figure
        if stem.startswith("sweep_goodput"):
            return 0 if label == "load" else 1
        return 2 if stem == "goodput" else 3

    if not figures:
        return []
    label, stem, link = min(figures, key=rank)  # min keeps the first of equal rank
    return [
        f"![{stem}]({link})",
        "",
        f"`{stem}` of the `{label}` ablation (every plot is in its section below).",
        "",
    ]


def glance(verdicts: list[str]) -> str:
    """One cell per source: the verdict, or with several points how many got which; `–`
    where the source has no arm for the claim."""
    if all(v == NOT_MEASURED for v in verdicts) and len(verdicts) > 1:
        return "–"
    if len(verdicts) == 1:
        return verdicts[0]
    counts = {
        v: verdicts.count(v) for v in (HELD, NOT_HELD, INCONCLUSIVE, IDLE, NOT_MEASURED) if v in verdicts
    }
    return ", ".join(f"{v} {n}/{len(verdicts)}" for v, n in counts.items())


def _check_leaderboard_owner(leaderboard: Path, report_path: Path) -> None:
    """Refuse to overwrite a leaderboard written with another report (its header names it):
    `--out docs/x.md` must not replace the leaderboard of docs/results.md."""
    if not leaderboard.is_file():
        return
    found = re.search(r"with the report \(([^)]*)\)", leaderboard.read_text()[:4000])
    if found and Path(found.group(1)).resolve() != report_path.resolve():
        raise FileExistsError(
            f"{leaderboard} is the leaderboard of the report {found.group(1)}; write this one's "
            "elsewhere (--leaderboard PATH) or remove it"
        )


def _write_leaderboard(
    sources: list[Source], path: Path, command: str, design_arms: tuple[str, ...], report_path: Path
) -> None:
    images = path.parent / path.stem
    if images.exists():
        shutil.rmtree(images)  # stale plots of an earlier report must not linger
    sections = [
        (source.label + (f" ({label})" if label else ""), arms, points)
        for source in sources
        for label, arms, _, points in source.points()
    ]
    body = leaderboard_markdown(sections, images, path.parent, design_arms)
    path.write_text(
        "# Leaderboard\n\n"
        f"Generated by `{command}` with the report ({report_path}): every policy at every point "
        "of every ablation, best goodput first. Means over seeds with 95% intervals (Student t, "
        "clipped to the metric's range); `dominated by` lists the arms that beat it on goodput, the "
        "top class's TTFT p99 or its SLO attainment by a paired interval and are worse on none "
        "(experiments/dominance.py); `front` marks the arms nobody dominates. Each plot: goodput "
        "against the top class's TTFT p99, and SLO attainment against KV moved; hollow markers "
        "are dominated arms, grey ones the arms other than the design's and the baselines.\n\n"
        "What each policy was told of a request's length (arms named `*_oracle` are told the true "
        "output length, an upper bound):\n\n"
        + "".join(f"- `{s.label}`: {length_regime(s.rows)}\n" for s in sources)
        + "\n"
        + body
    )


def report(
    quick: str | Path,
    out: str | Path,
    paper: str | Path | None = None,
    command: str = "",
    sweeps: list[str | Path] = (),
    early: str | Path | None = None,
    compare: Sequence[str] = (),
    codec: str | Path | None = None,
    headline: str | Path | None = None,
    multiplicity: str = "bh",
    leaderboard: str | Path | None = None,
) -> list[Path]:
    """Write the report to `out` (plots copied to `out`'s stem directory) and the
    leaderboard to `leaderboard` (default `leaderboard.md` beside the report; its Pareto
    plots under the folder of its stem); returns every file and folder written. A
    leaderboard file another report wrote is never overwritten (FileExistsError: name
    another with `leaderboard`). Each ablation is labelled by its config's
    name (`Source.load`). `sweeps`: more ablation directories (regime sweeps), each
    judged per grid point. `early`: a `preempt bench early --windows` result (its
    result.json, or what `--json` prints), shown as the early-save policies side by side.
    `compare`: a user's own arms, judged against every named baseline by the design's two
    claims (experiments.claims.design_claims) and shown in "what to run where". `codec`: a
    `preempt bench codec --json` result, which the codec claim is judged from (without it,
    `not measured by this run`). `headline`: the headline ablation's directory
    (preempt/configs/headline.yaml), which opens the page and joins the leaderboard.
    `multiplicity`: the correction over the report's verdicts ("bh", "holm", "none")."""
    out = Path(out)
    extra = [arm for arm in compare if arm not in DESIGN_ARMS]
    design_arms = (*DESIGN_ARMS, *extra)
    # a reader's own arms first: the claims they asked about lead every table
    claims = [*(claim for arm in extra for claim in design_claims(arm)), *CLAIMS]
    sources = [Source.load("quick", quick)]
    for flag, path in [("paper", paper)] * (paper is not None) + [("sweep", path) for path in sweeps]:
        sources.append(Source.load(flag, path, taken=[source.label for source in sources]))
    top = Source.load("headline", headline) if headline is not None else None
    leaderboard = Path(leaderboard) if leaderboard is not None else out.parent / "leaderboard.md"
    _check_leaderboard_owner(leaderboard, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    leaderboard.parent.mkdir(parents=True, exist_ok=True)
    command = command or f"preempt report --quick {quick} --out {out}"
    bench = judge_benchmarks({"codec": codec})
    link = os.path.relpath(leaderboard, out.parent)
    text = render(sources, out, command, claims, design_arms, bench, top, multiplicity, link)
    _write_leaderboard([*([top] if top else []), *sources], leaderboard, command, design_arms, out)
    if paper is None:
        text += (
            "\n## Paper ablation\n\nNot run for this report: `preempt ablate --config "
            "preempt/configs/paper.yaml --out runs/ablate-paper [--ray-address ADDR]` "
            "(docs/regimes.md: its time on N Ray workers), then add `--paper runs/ablate-paper`.\n"
        )
    if early is not None:
        from preempt.bench.early_windows import render_windows

        result = json.loads(Path(early).read_text())
        num_windows = len({tuple(row["window_s"]) for row in result["windows"]})
        text += (
            "\n## Early saves, side by side\n\n"
            f"`preempt bench early --windows` over {num_windows} held-out windows: with so few, the "
            "intervals are wide; docs/predictor.md has the study over four windows and three training "
            "seeds.\n\n" + render_windows(result)
        )
    out.write_text(text)
    images = [out.parent / out.stem] if any(source.plots() for source in sources) else []
    pareto = leaderboard.parent / leaderboard.stem  # removed and written again: there iff plotted
    return [out, *images, leaderboard, *([pareto] if pareto.is_dir() else [])]
