"""Step-identical agreement with vLLM 0.32's own V1 scheduler, driven in the peer
virtualenv (`make peer`), on the bundled workloads and on random ones generated here,
under both of vLLM's policies and under FCFS with RFC #54644's least-computed-first victim
patched into vLLM's own scheduler source (`vllm_lcf`); and a known difference reported at
the step it happens.

Skipped when no peer is installed, except where PREEMPT_REQUIRE_PEER=1 (CI) turns that
into a failure: parity must never pass by not running.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from preempt.parity.harness import PeerError, peer_python, run_parity
from preempt.parity.workload import bundled_names, load_workload, parse_workload


@pytest.fixture(scope="module")
def peer():
    try:
        return peer_python()
    except PeerError as err:
        if os.environ.get("PREEMPT_REQUIRE_PEER") == "1":
            pytest.fail(f"PREEMPT_REQUIRE_PEER=1 but {err}")
        pytest.skip(str(err))


def random_workload(seed: int):
    """A workload no one tuned: random sizes, budgets, arrivals and priorities."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([8, 16, 32]))
    num_requests = int(rng.integers(5, 50))
    prompts = rng.integers(1, 600, num_requests)
    outputs = rng.integers(1, 300, num_requests)
    longest = int((prompts + outputs).max())
    # Between "one request at a time" and "about a third of them at once".
    min_blocks = -(-longest // block_size) + 1
    num_gpu_blocks = int(rng.integers(min_blocks, min_blocks * 4))
    return parse_workload(
        {
            "block_size": block_size,
            "num_gpu_blocks": num_gpu_blocks,
            "max_num_seqs": int(rng.integers(2, 17)),
            "max_num_batched_tokens": int(rng.choice([16, 64, 128, 512, 2048])),
            "requests": [
                {
                    "id": int(i),
                    "prompt_tokens": int(p),
                    "output_tokens": int(o),
                    "arrival_step": int(a),
                    "priority": int(q),
                }
                for i, (p, o, a, q) in enumerate(
                    zip(
                        prompts,
                        outputs,
                        np.sort(rng.integers(0, 200, num_requests)),
                        rng.integers(-1, 3, num_requests),
                        strict=True,
                    )
                )
            ],
        },
        name=f"random-{seed}",
    )


POLICIES = ["fcfs", "priority", "lcf"]


@pytest.fixture(scope="module")
def agreement(peer):
    workloads = [load_workload(name) for name in bundled_names()]
    workloads += [random_workload(seed) for seed in range(8)]
    return run_parity(workloads, POLICIES, python=peer)


def test_every_bundled_workload_is_step_identical_under_every_policy(agreement):
    assert agreement["vllm_version"] == "0.32.0"
    bundled = [run for run in agreement["runs"] if not run["workload"].startswith("random-")]
    assert len(bundled) == len(POLICIES) * len(bundled_names()) >= 18
    assert {run["vllm_config"]["policy"] for run in bundled} == set(POLICIES)
    for run in bundled:
        assert run["vllm_config_problems"] == [], run["workload"]
        assert run["identical"], (run["workload"], run["policy"], run["first_divergence"])
        assert run["totals"]["vllm"] == run["totals"]["preempt"]
    # The mechanism is exercised, not only the easy path.
    assert sum(run["totals"]["vllm"]["preemptions"] > 0 for run in bundled) >= 18


def test_the_patched_victim_rule_changes_what_vllm_does(agreement):
    # the LCF runs are vLLM deciding otherwise than its FCFS, not FCFS again
    totals = {(run["workload"], run["policy"]): run["totals"]["vllm"] for run in agreement["runs"]}
    differ = [name for name in bundled_names() if totals[(name, "lcf")] != totals[(name, "fcfs")]]
    assert len(differ) >= 4, differ


def test_random_workloads_never_tuned_are_step_identical(agreement):
    random_runs = [run for run in agreement["runs"] if run["workload"].startswith("random-")]
    assert len(random_runs) == 8 * len(POLICIES)
    for run in random_runs:
        assert run["identical"], (run["workload"], run["policy"], run["first_divergence"])
    assert sum(run["totals"]["vllm"]["preemptions"] for run in random_runs) > 0


def test_first_chunk_admission_differs_from_vllm_at_the_step_it_admits(peer):
    # 10 usable blocks of 16. Request 0 (124 tokens, 8 blocks at its end) holds 4 blocks
    # after its 64-token prompt; at step 2 it takes a 5th. Request 1 arrives then with a
    # 100-token prompt (7 blocks): vLLM 0.32 needs all 7 free and waits; the old rule
    # admits its first 31-token chunk (2 blocks) right away.
    workload = parse_workload(
        {
            "block_size": 16,
            "num_gpu_blocks": 11,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 32,
            "requests": [
                {"id": 0, "prompt_tokens": 64, "output_tokens": 60},
                {"id": 1, "prompt_tokens": 100, "output_tokens": 4, "arrival_step": 2},
            ],
        },
        name="admission-gate",
    )
    same = run_parity([workload], ["fcfs"], python=peer)
    assert same["identical"]
    differ = run_parity([workload], ["fcfs"], ["scheduler.reserve_full_sequence=false"], python=peer)
    run = differ["runs"][0]
    assert not differ["identical"] and not run["identical"]
    first = run["first_divergence"]
    assert first["step"] == 2 and first["field"] == "scheduled"
    assert "1" not in first["vllm"] and first["preempt"]["1"] == [0, 31]
