"""Check that docs/results.md's quick column says what a fresh `make run` says.

`make run` writes runs/main/results.md (`preempt report --quick runs/main/ablate`);
docs/results.md is `make results` (the same quick ablation plus the sweeps). Their
"Claims at a glance" tables must give every claim the same quick verdict: otherwise the
committed docs describe a run nobody can reproduce from this commit.

Usage: python scripts/check_results.py [RUN_RESULTS] [DOCS_RESULTS]
(runs/main/results.md, docs/results.md). Exits 1 and lists the claims that differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

HEADING = "## Claims at a glance"


def quick_verdicts(path: Path) -> dict[str, str]:
    """claim -> its `quick` cell, from the file's "Claims at a glance" table."""
    lines = path.read_text().splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        raise SystemExit(f"{path}: no '{HEADING}' section") from None
    table: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append(line)
        elif table:  # the first table under the heading ends here
            break
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    if "quick" not in header:
        raise SystemExit(f"{path}: the '{HEADING}' table has no quick column")
    column = header.index("quick")
    verdicts = {}
    for row in table[2:]:  # past the header and the --- line
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        verdicts[cells[0]] = cells[column]
    return verdicts


def main(argv: list[str]) -> int:
    run = Path(argv[0] if argv else "runs/main/results.md")
    docs = Path(argv[1] if len(argv) > 1 else "docs/results.md")
    ran, documented = quick_verdicts(run), quick_verdicts(docs)
    missing = "no such claim"
    differ = [
        f"  {claim}: {run} says '{ran.get(claim, missing)}', {docs} says '{documented.get(claim, missing)}'"
        for claim in sorted(set(ran) | set(documented))
        if ran.get(claim) != documented.get(claim)
    ]
    if differ:
        print(
            f"{len(differ)} of {len(set(ran) | set(documented))} quick verdicts differ:\n" + "\n".join(differ)
        )
        return 1
    print(f"all {len(ran)} quick verdicts agree ({run} and {docs})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
