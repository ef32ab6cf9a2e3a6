"""Output quality of a run against its ablation's quality reference (greedy tokens).

Owns: `output_agreement` (token agreement and exact-match share of two runs' outputs) and
`score_quality`, which fills those two columns of a results row and says why they stay
NaN when they must.

Must never: judge a lossy mode acceptable (that is the report's claim), or read anything
but the two runs' `requests.parquet`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from experiments.catalogue import NAN
from experiments.plan import AblationPlan, ArmRun, run_key


def output_agreement(run_dir: Path, reference_dir: Path) -> tuple[float, float, int]:
    """(token agreement, exact-match share, requests compared) of this run's greedy outputs
    against the reference's, over requests that finished in both. Token agreement counts
    equal tokens position by position over each pair's common length (a lossy restore
    that flips one token usually changes the rest, so this is a strict measure)."""
    columns = ["request_id", "final_state", "output_token_ids"]
    mine = pq.read_table(run_dir / "requests.parquet", columns=columns).to_pydict()
    ref = pq.read_table(reference_dir / "requests.parquet", columns=columns).to_pydict()
    ref_tokens = {
        rid: tokens for rid, state, tokens in zip(*ref.values(), strict=True) if state == "FINISHED"
    }
    num_equal = num_common = num_exact = num_compared = 0
    for rid, state, tokens in zip(*mine.values(), strict=True):
        if state != "FINISHED" or rid not in ref_tokens:
            continue
        a, b = np.asarray(tokens), np.asarray(ref_tokens[rid])
        common = min(len(a), len(b))
        num_equal += int((a[:common] == b[:common]).sum())
        num_common += common
        num_exact += len(a) == len(b) and bool((a == b).all())
        num_compared += 1
    if not num_compared:
        return NAN, NAN, 0
    return (num_equal / num_common if num_common else NAN), num_exact / num_compared, num_compared


def score_quality(
    plan: AblationPlan,
    run: ArmRun,
    out_dir: Path,
    outcomes: dict[str, dict[str, Any]],
    reference: str | None,
    row: dict[str, Any],
) -> str:
    """Fill token_agreement / exact_match_share; returns why they stay NaN ('' if not)."""
    if run.config.model.backend == "null":
        return "null backend: no real tokens (outputs are placeholders, equal by construction)"
    if reference is None:
        return "no quality_reference in the ablation config"
    ref_key = run_key(reference, run.grid_point)
    if ref_key == run.key:
        return "the quality reference itself"
    if outcomes.get(ref_key, {}).get("status") != "ok":
        return f"quality reference '{ref_key}' did not run"
    agreement, exact, num = output_agreement(out_dir / "arms" / run.key, out_dir / "arms" / ref_key)
    row["token_agreement"], row["exact_match_share"] = agreement, exact
    return "" if num else "no request finished in both runs"
