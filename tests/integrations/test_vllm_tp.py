"""preempt's plugin and KV connector under tensor parallelism 2 on CPU (two worker
processes, one core each): every copy stored and loaded by both workers, the same tokens
as plain vLLM at TP 2. Skipped without a peer unless PREEMPT_REQUIRE_PEER=1 (CI)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.parity.test_vllm_parity import peer  # noqa: F401 - the shared fixture

SCRIPT = Path(__file__).with_name("vllm_tp2.py")
REPO = Path(__file__).resolve().parents[2]


def test_tp2_copies_are_stored_and_loaded_by_both_workers(peer, tmp_path):  # noqa: F811
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [str(peer), str(SCRIPT), str(tmp_path / "served")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"tp"')]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["tp"] == 2 and result["requests"] == 12
    assert result["same_tokens_as_plain_vllm"]  # raw copies of both shards: lossless
    connector = result["connector"]
    assert connector["saves"] > 0 and connector["loads"] > 0
    assert not any(connector["fallbacks"].values())
