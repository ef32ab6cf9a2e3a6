"""The request latencies, defined once (seconds on the engine's clock).

- ttft = first_token_s - arrival_s (queueing + prefill, incl. recompute after preemption)
- tpot = (finish_s - first_token_s) / (output_tokens - 1): one-token outputs have none
- e2e  = finish_s - arrival_s

Each is None while its timestamps are not set. `preempt.obs.results` turns them into the
requests.parquet columns and summary.json percentiles (NaN for requests that did not
finish); the server's end event and `preempt.obs.metrics` report the same quantities.
Plain Python, no pyarrow: the server imports this module at start-up.
"""

from __future__ import annotations

from preempt.core.request import Request


def ttft_s(request: Request) -> float | None:
    if request.first_token_s is None:
        return None
    return request.first_token_s - request.arrival_s


def tpot_s(request: Request) -> float | None:
    num_out = request.num_output_tokens
    if request.finish_s is None or request.first_token_s is None or num_out < 2:
        return None
    return (request.finish_s - request.first_token_s) / (num_out - 1)


def e2e_s(request: Request) -> float | None:
    if request.finish_s is None:
        return None
    return request.finish_s - request.arrival_s
