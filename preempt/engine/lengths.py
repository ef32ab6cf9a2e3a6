"""A learned model of how long a running request will still run: the per-token hazard of
its output ending, from logged requests.

A server knows a request's prompt length, its `max_tokens` and how many tokens it has
generated, never its true output length; under a loose `max_tokens` (a fixed cap, or a
client's guess) that is the one thing the cheap forecast (preempt.early.projection) is
blind to: it runs every request to `max_tokens`, so it cannot see the finishes that free
the seats and blocks a predicted preemption needed. This model gives, for a request with
`n` tokens generated, the probability that its output ends at the next token.

Estimator: a life table (the actuarial hazard). Output positions are grouped in
geometric bins (four per octave); in each bin, hazard = natural ends in the bin / tokens
generated in it (the exposure). An output that stopped at its `max_tokens` ended by the
cap, not by itself: it counts as exposure only (censored), and the cap itself is applied
exactly (`hazard` is 1 at `max_tokens`). The table is kept per cell of (prompt length,
max_tokens), each in log2 bins, shrunk toward the pooled table of all cells by the
exposure of `PRIOR_REQUESTS` average requests, so a thin cell reads as the pool and a
rich cell as itself. Fitting and lookup are plain numpy and Python: deciding code, no tensors.

Files are JSON (`LengthModel.save`), with the trace windows the requests came from, so a
bench can refuse to judge the model on the requests it was fitted to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from preempt.core.config import WorkloadConfig
    from preempt.core.request import Request

FORMAT = "preempt-lengths-v1"
PRIOR_REQUESTS = 50.0
"""Every cell starts from the pooled hazard with the exposure of this many average
requests (per position bin: the pool's exposure there per request, times this)."""
_POSITION_BINS_PER_OCTAVE = 4
_MAX_POSITION = 1 << 17
_MAX_CACHED = 1 << 16  # request ids whose cell is remembered (then forgotten at once)
_MAX_LOG2 = 17  # prompt and max_tokens bins: [1, 2), [2, 4), ... up to 2^17 and above


def _position_edges() -> np.ndarray:
    """Bin edges of output positions (the token about to be generated is position n + 1):
    every position up to 8, then four geometric bins per octave."""
    steps = np.arange(0, _POSITION_BINS_PER_OCTAVE * 17 + 1)
    edges = np.unique(np.round(2.0 ** (steps / _POSITION_BINS_PER_OCTAVE)).astype(np.int64))
    return np.concatenate([edges[edges < _MAX_POSITION], [_MAX_POSITION]])


_EDGES = _position_edges()  # bin b holds positions [edges[b], edges[b + 1])
# position -> bin, as a table for the positions that matter most (lookups are per token)
_BIN_OF = np.searchsorted(_EDGES, np.arange(4097), side="right") - 1


def _log2_bin(value: int) -> int:
    return min(max(int(value), 1).bit_length() - 1, _MAX_LOG2)


def _position_bin(position: int) -> int:
    if position < len(_BIN_OF):
        return int(_BIN_OF[position])
    return min(int(np.searchsorted(_EDGES, position, side="right")) - 1, len(_EDGES) - 2)


def _life_table(output: np.ndarray, capped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ends, exposure) per position bin: natural ends with their last position in the bin,
    and positions generated in the bin, over requests with `output` tokens (those with
    `capped` stopped at max_tokens: exposure only)."""
    num_bins = len(_EDGES) - 1
    lo, hi = _EDGES[:-1], _EDGES[1:]
    exposure = np.clip(np.minimum(output[:, None] + 1, hi[None, :]) - lo[None, :], 0, None).sum(axis=0)
    natural = output[~capped]
    ends = np.bincount(np.searchsorted(_EDGES, natural, side="right") - 1, minlength=num_bins)[:num_bins]
    return ends.astype(np.float64), exposure.astype(np.float64)


class LengthModel:
    """hazard(prompt_tokens, max_tokens, num_output): P(the output ends at the next token)."""

    def __init__(
        self,
        pooled: np.ndarray,
        cells: dict[tuple[int, int], np.ndarray],
        num_requests: int,
        windows: list[dict[str, Any]] | None = None,
    ) -> None:
        self.pooled = pooled  # (bins,) hazard per token, every cell together
        self.cells = cells  # (prompt bin, max_tokens bin) -> (bins,) shrunk hazard
        self.num_requests = num_requests
        self.windows = windows or []  # the trace windows the requests came from
        # the tables stacked, one row per cell and the pool last (`hazard`, `expected_ends`)
        keys = sorted(cells)
        self._row = {key: i for i, key in enumerate(keys)}
        self._pooled_row = len(keys)
        self._matrix = np.stack([*(cells[key] for key in keys), pooled])
        self._row_of: dict[int, int] = {}  # request id -> its row of _matrix
        self._survival: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (S, cumsum S)

    @classmethod
    def fit(
        cls,
        prompt_tokens: Sequence[int],
        max_tokens: Sequence[int],
        output_tokens: Sequence[int],
        windows: list[dict[str, Any]] | None = None,
    ) -> LengthModel:
        """From finished requests: their prompt length, max_tokens and output length."""
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        cap = np.asarray(max_tokens, dtype=np.int64)
        output = np.asarray(output_tokens, dtype=np.int64)
        if not (len(prompt) == len(cap) == len(output)):
            raise ValueError("prompt_tokens, max_tokens and output_tokens must have one entry per request")
        if len(output) == 0:
            raise ValueError("no finished requests to fit an output-length model on")
        if (output < 1).any() or (cap < output).any():
            raise ValueError("every output length must be >= 1 and <= its max_tokens")
        capped = output >= cap
        ends, exposure = _life_table(output, capped)
        pooled = _fill(ends, exposure)
        prior = PRIOR_REQUESTS * exposure / len(output)  # (bins,) pseudo-exposure per cell
        keys = np.stack([[_log2_bin(p) for p in prompt], [_log2_bin(c) for c in cap]], axis=1)
        cells: dict[tuple[int, int], np.ndarray] = {}
        for key in {tuple(k) for k in keys.tolist()}:
            mask = (keys == key).all(axis=1)
            cell_ends, cell_exposure = _life_table(output[mask], capped[mask])
            shrunk = (cell_ends + prior * pooled) / np.maximum(cell_exposure + prior, 1e-12)
            cells[key] = np.where(cell_exposure + prior > 0, shrunk, pooled)
        return cls(pooled, cells, len(output), windows)

    @classmethod
    def from_requests(
        cls, paths: Sequence[str | Path], windows: list[dict[str, Any]] | None = None
    ) -> LengthModel:
        """From runs' requests.parquet (preempt.obs.results): the requests that finished."""
        import pyarrow.parquet as pq

        from preempt.core.request import RequestState

        columns = {"prompt_tokens": [], "max_tokens": [], "output_tokens": []}
        for path in paths:
            if not Path(path).is_file():
                raise ValueError(f"no such file: {path} (a run's requests.parquet)")
            try:
                table = pq.read_table(path, columns=[*columns, "final_state"]).to_pydict()
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read requests from {path}: {exc}") from None
            for i, state in enumerate(table["final_state"]):
                if state == RequestState.FINISHED.value:
                    for name, values in columns.items():
                        values.append(table[name][i])
        return cls.fit(columns["prompt_tokens"], columns["max_tokens"], columns["output_tokens"], windows)

    @classmethod
    def from_trace(cls, workload: WorkloadConfig, seed: int, exclude: tuple[float, float]) -> LengthModel:
        """From the trace's own records outside `exclude` (a window [start, end) of trace
        seconds): what a server running the rest of the trace would have logged, each
        request told max_tokens as `workload.max_tokens_mode` tells it. For judging the
        model on the excluded window without having fitted it there."""
        from preempt.core.workload import build_workload

        whole = workload.model_copy(
            update={"start_s": 0.0, "duration_s": None, "num_requests": None, "arrival": "trace"}
        )
        requests = build_workload(whole, seed)
        start, end = exclude
        kept = [r for r in requests if not start <= r.arrival_s * whole.rate_scale < end]
        span = requests[-1].arrival_s * whole.rate_scale
        windows = [
            {"trace": workload.trace, "start_s": lo, "end_s": hi}
            for lo, hi in ((0.0, start), (end, span))
            if hi > lo
        ]
        return cls.fit(
            [r.num_prompt_tokens for r in kept],
            [r.max_tokens for r in kept],
            [r.output_limit for r in kept],
            windows,
        )

    def _row_for(self, prompt_tokens: int, max_tokens: int) -> int:
        """The row of `_matrix` for a request: its cell's, or the pool's."""
        return self._row.get((_log2_bin(prompt_tokens), _log2_bin(max_tokens)), self._pooled_row)

    def hazard(self, prompt_tokens: int, max_tokens: int, num_output: int) -> float:
        """P(the output ends at token num_output + 1 | it has not ended by num_output)."""
        if num_output + 1 >= max_tokens:
            return 1.0
        return float(self._matrix[self._row_for(prompt_tokens, max_tokens), _position_bin(num_output + 1)])

    def expected_output_left(self, prompt_tokens: int, max_tokens: int, num_output: int) -> float:
        """E[output tokens still to come | not ended after `num_output`], under the cap
        `max_tokens`: sum over q in [n, C) of S(q) / S(n), where S(q) = P(output > q) is
        the row's survival. At least 1 (a running request makes its next token), 0 at the
        cap. O(1) per call after a row's survival is tabulated once (`_survival_of`)."""
        n, cap = int(num_output), int(max_tokens)
        if n >= cap:
            return 0.0
        survival, cumulative = self._survival_of(self._row_for(prompt_tokens, max_tokens), cap)
        if survival[n] <= 1e-300:  # every modelled output ended before here: the next token
            return 1.0
        below = cumulative[n - 1] if n > 0 else 0.0
        return float((cumulative[cap - 1] - below) / survival[n])

    def _survival_of(self, row: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """(S, cumsum S) of a row over positions 0..N >= cap: S[q] = P(output > q), S[0] = 1."""
        table = self._survival.get(row)
        if table is None or len(table[0]) <= cap:
            size = max(4096, 1 << int(cap).bit_length())  # a power of two above the cap
            positions = np.arange(1, size)
            bins = np.minimum(np.searchsorted(_EDGES, positions, side="right") - 1, len(_EDGES) - 2)
            survival = np.concatenate([[1.0], np.cumprod(1.0 - self._matrix[row, bins])])  # (size,)
            table = self._survival[row] = (survival, np.cumsum(survival))
        return table

    def expected_ends(self, running: Sequence[Request], num_tokens: int) -> np.ndarray:
        """(num_tokens,) expected natural ends among `running` within each of the next
        1..num_tokens tokens (cumulative): the sum of each decoding request's hazards. A
        request's end at its `max_tokens` is certain and the projection models it, so it
        is not counted (nor anything after it); a request still prefilling produces no
        token to end on. Vectorised over requests x tokens (it runs every engine step)."""
        rows, outputs, caps = [], [], []
        row_of = self._row_of
        if len(row_of) > _MAX_CACHED:
            row_of.clear()
        for request in running:
            num_output = len(request.output_token_ids)
            if request.num_computed_tokens < request.num_prompt_tokens + num_output - 1:
                continue  # still prefilling
            row = row_of.get(request.request_id)
            if row is None:  # its cell, once: prompt length and max_tokens do not change
                row = row_of[request.request_id] = self._row_for(
                    request.num_prompt_tokens, request.max_tokens
                )
            rows.append(row)
            outputs.append(num_output)
            caps.append(request.max_tokens)
        if not rows or num_tokens <= 0:
            return np.zeros(max(num_tokens, 0))
        positions = np.asarray(outputs)[:, None] + 1 + np.arange(num_tokens)[None, :]  # (R, T)
        bins = _BIN_OF[np.minimum(positions, len(_BIN_OF) - 1)]
        far = positions >= len(_BIN_OF)
        if far.any():  # beyond the lookup table: search the edges
            bins[far] = np.minimum(np.searchsorted(_EDGES, positions[far], side="right") - 1, len(_EDGES) - 2)
        hazards = self._matrix[np.asarray(rows)[:, None], bins]
        hazards[positions >= np.asarray(caps)[:, None]] = 0.0  # the cap ends it: the projection knows
        return np.cumsum(hazards.sum(axis=0))

    def confident_steps(self, running: Sequence[Request], budget: float, max_steps: int) -> int:
        """How many steps ahead a projection that runs every request to its max_tokens can
        be trusted: the largest k (1..max_steps) such that the natural ends expected among
        `running` before the k-th step's schedule (k - 1 tokens each) are at most
        `budget`, i.e. P(none of them ends) >= exp(-budget). The next schedule (k = 1)
        sees no new token, so it is always trusted."""
        totals = self.expected_ends(running, max(max_steps - 1, 0))
        return 1 + int(np.searchsorted(totals, budget, side="right"))

    def save(self, path: str | Path) -> None:
        doc = {
            "format": FORMAT,
            "num_requests": self.num_requests,
            "windows": self.windows,
            "position_edges": _EDGES.tolist(),
            "pooled": self.pooled.tolist(),
            "cells": [[p, c, table.tolist()] for (p, c), table in sorted(self.cells.items())],
        }
        Path(path).write_text(json.dumps(doc) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LengthModel:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the length model {path}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path} is not a length model (format {FORMAT!r})")
        if doc.get("position_edges") != _EDGES.tolist():
            raise ValueError(f"{path} was fitted with other position bins; fit it again")
        cells = {(int(p), int(c)): np.asarray(table, dtype=np.float64) for p, c, table in doc["cells"]}
        return cls(
            np.asarray(doc["pooled"], dtype=np.float64), cells, int(doc["num_requests"]), doc["windows"]
        )


def _fill(ends: np.ndarray, exposure: np.ndarray) -> np.ndarray:
    """Hazard per bin; a bin nobody reached takes the last observed bin's hazard."""
    hazard = np.zeros_like(ends)
    seen = exposure > 0
    hazard[seen] = ends[seen] / exposure[seen]
    last = 0.0
    for b in range(len(hazard)):
        if seen[b]:
            last = hazard[b]
        else:
            hazard[b] = last
    return hazard
