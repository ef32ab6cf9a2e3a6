"""preempt's Triton kernels live under preempt's own import name (`preempt.kernels`).

Hugging Face's `kernels` distribution owns the top-level name `kernels`, and transformers
5.x imports it at load time (`transformers.integrations.hub_kernels`). A top-level
`kernels` package of ours shadowed it: `from kernels import CUDAProperties` found our
folder. These tests import both in one process, the way `preempt serve --set
model.backend=hf` does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_no_top_level_kernels_package_in_the_repo():
    # The repo root is on sys.path under pytest and `python -m`: a kernels/ there shadows HF's.
    assert not (REPO / "kernels").exists()
    assert (REPO / "preempt" / "kernels" / "__init__.py").is_file()


def test_transformers_hub_kernels_and_preempt_kernels_in_one_process():
    pytest.importorskip("transformers")
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("Hugging Face's kernels distribution is not installed")
    # A fresh interpreter from the repo root, so nothing imported by other tests helps.
    script = (
        "import preempt.kernels.quantize_heads, preempt.kernels.restore_blocks\n"
        "import transformers.integrations.hub_kernels as hub\n"
        "import kernels\n"
        "from kernels import CUDAProperties\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert is_kernels_available()\n"
        "print(kernels.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf_kernels = Path(done.stdout.strip().splitlines()[-1]).resolve()
    assert "site-packages" in hf_kernels.parts, hf_kernels  # Hugging Face's, not a folder of ours
