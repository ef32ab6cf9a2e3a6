"""The claims the results page judges, and how each is judged.

Where a claim is defined: `catalogue` (every claim, in one list: its sentence, source,
arms, metric, bound and regime). A claim that is one paired interval against a bound is
a `PairedTest` declaration judged by `paired.judge`, its method text written from it by
`paired.describe`; the claims with their own logic name their function in `rules`.
`base` holds the verdicts, `Finding`, `Claim` / `BenchClaim` and the pieces every judge
shares. Rendering them is experiments.report's.
"""

from experiments.claims.base import (
    HELD,
    IDLE,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    BenchClaim,
    Claim,
    Finding,
    is_nan,
)
from experiments.claims.catalogue import (
    BENCH_CLAIMS,
    CLAIMS,
    DESIGN_CLAIMS,
    STRICT_MARGIN,
    claim_named,
    design_claims,
    share_claim,
)
from experiments.claims.paired import PairedTest, describe, judge, paired_claim
from experiments.dominance import Arms

__all__ = [
    "BENCH_CLAIMS",
    "CLAIMS",
    "DESIGN_CLAIMS",
    "HELD",
    "IDLE",
    "INCONCLUSIVE",
    "NOT_HELD",
    "NOT_MEASURED",
    "STRICT_MARGIN",
    "Arms",
    "BenchClaim",
    "Claim",
    "Finding",
    "PairedTest",
    "claim_named",
    "describe",
    "design_claims",
    "is_nan",
    "judge",
    "paired_claim",
    "share_claim",
]
