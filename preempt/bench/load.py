"""A real load generator (guidellm) against `preempt serve`, and the timings it reports.

Owns: the byte-level tokenizer file guidellm counts tokens with (the `tiny` backend's
ids are UTF-8 bytes, so token id i is byte i), the guidellm command line (a sweep of
constant request rates, each bounded in requests and seconds), reading guidellm's JSON
report back into per-request timings, and the summary both sides of `preempt bench serve`
are reported in (throughput, TTFT and ITL percentiles computed by the same code).

It sends traffic only to the URL it is given (the bench and the tests pass 127.0.0.1) and
never touches the network otherwise: guidellm runs with the Hugging Face hubs offline and
loads the tokenizer from a local directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from preempt.model.tokenizer import write_byte_tokenizer

PERCENTILES = (50, 90, 99)
INSTALL_HINT = "pip install -c constraints.txt -e '.[load]'"


class RequestTiming(NamedTuple):
    """One finished request, seconds on one clock (wall time of whoever measured it)."""

    start_s: float  # sent (guidellm) / arrived (in-process)
    first_token_s: float
    last_token_s: float
    num_output_tokens: int


class LoadRun(NamedTuple):
    """One rate of the sweep as guidellm measured it."""

    rate: float  # requests/s asked for
    timings: list[RequestTiming]  # successful requests, in send order
    prompts: list[str]  # the prompts guidellm sent, same order
    num_prompt_tokens: list[int]  # the server's count (usage.prompt_tokens) of each
    num_errored: int
    num_incomplete: int


def guidellm_installed() -> bool:
    return importlib.util.find_spec("guidellm") is not None


def guidellm_command(
    url: str,
    tokenizer_dir: Path,
    output_path: Path,
    rates: Sequence[float],
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    max_seconds_per_rate: float,
    seed: int = 0,
) -> list[str]:
    """`guidellm run`: streamed /v1/completions at each constant rate, `num_requests`
    each, a rate stopped after `max_seconds_per_rate` (unfinished ones count as
    incomplete), a 60 s per-request read timeout."""
    return [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={url},request_format=/v1/completions,timeout=60",
        "--profile",
        "kind=constant",
        "--override",
        "profile.rate",
        ",".join(f"{rate:g}" for rate in rates),
        "--constraint",
        f"kind=max_requests,count={num_requests}",
        "--constraint",
        f"kind=max_duration,seconds={max_seconds_per_rate:g}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--seed",
        f"kind=static,value={seed}",
        "--output",
        f"kind=json,path={output_path}",
        "--disable-console",
    ]


def run_guidellm(
    url: str,
    workdir: Path,
    rates: Sequence[float],
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    max_seconds_per_rate: float = 60.0,
) -> list[LoadRun]:
    """Run the sweep in a subprocess (cwd `workdir`, where its files go) and read it back."""
    tokenizer_dir = write_byte_tokenizer(workdir / "byte_tokenizer")
    output_path = workdir / "guidellm.json"
    command = guidellm_command(
        url,
        tokenizer_dir,
        output_path,
        rates,
        num_requests,
        prompt_tokens,
        output_tokens,
        max_seconds_per_rate,
    )
    env = {
        **os.environ,
        # No hub look-ups: the tokenizer is the local directory above.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        # Loopback must never go through a proxy set in the environment.
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        # guidellm spawns 10 worker processes by default; on a 2-core machine that is
        # start-up time and client CPU stolen from the server. Two keep up at these rates.
        "GUIDELLM__MAX_WORKER_PROCESSES": os.environ.get("GUIDELLM__MAX_WORKER_PROCESSES", "2"),
        "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING",
    }
    budget_s = 45.0 + len(rates) * (max_seconds_per_rate + 15.0)  # start-up ~10 s, ~5 s a rate
    # Its own session, so a run past the budget is ended with every worker it spawned.
    process = subprocess.Popen(
        command,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = process.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(f"guidellm ran past {budget_s:g} s and was stopped") from None
    if process.returncode != 0 or not output_path.is_file():
        raise RuntimeError(f"guidellm exited with {process.returncode}:\n{log[-2000:]}")
    return read_report(json.loads(output_path.read_text()))


def read_report(report: dict[str, Any]) -> list[LoadRun]:
    """guidellm's JSON report -> one LoadRun per benchmark (rate), in sweep order."""
    runs = []
    for benchmark in report["benchmarks"]:
        requests = benchmark["requests"]
        successful = sorted(requests["successful"], key=lambda r: r["request_start_time"])
        timings, prompts, prompt_counts = [], [], []
        for record in successful:
            start = record["request_start_time"]
            first = start + record["time_to_first_token_ms"] / 1000.0
            num_tokens = record["output_tokens"]
            # guidellm keeps the first and last token times only through TTFT and ITL.
            last = first + (record["inter_token_latency_ms"] or 0.0) * max(0, num_tokens - 1) / 1000.0
            timings.append(RequestTiming(start, first, last, num_tokens))
            prompts.append(json.loads(record["request_args"])["body"]["prompt"])
            prompt_counts.append(record["prompt_tokens"])
        runs.append(
            LoadRun(
                rate=float(benchmark["config"]["strategy"]["rate"]),
                timings=timings,
                prompts=prompts,
                num_prompt_tokens=prompt_counts,
                num_errored=len(requests["errored"]),
                num_incomplete=len(requests["incomplete"]),
            )
        )
    return runs


def summarize(timings: Sequence[RequestTiming]) -> dict[str, Any]:
    """Throughput over the span first start -> last token; TTFT per request (start -> first
    token); ITL per request as guidellm defines it, (last token - first token) / (tokens
    - 1); percentiles linear-interpolated over requests (every request here has the same
    output length, so that equals guidellm's per-token weighting)."""
    if not timings:
        return {"num_requests": 0}
    span_s = max(t.last_token_s for t in timings) - min(t.start_s for t in timings)
    ttft_ms = np.array([(t.first_token_s - t.start_s) * 1000.0 for t in timings])
    itl_ms = np.array(
        [
            (t.last_token_s - t.first_token_s) * 1000.0 / (t.num_output_tokens - 1)
            for t in timings
            if t.num_output_tokens > 1
        ]
    )
    summary: dict[str, Any] = {
        "num_requests": len(timings),
        "req_s": round(len(timings) / span_s, 1),
        "tok_s": round(sum(t.num_output_tokens for t in timings) / span_s),
    }
    for name, values in (("ttft_ms", ttft_ms), ("itl_ms", itl_ms)):
        if values.size:
            summary[name] = {f"p{p}": round(float(np.percentile(values, p)), 2) for p in PERCENTILES}
    return summary
