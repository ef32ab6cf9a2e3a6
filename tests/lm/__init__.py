"""Tests of the reference LM: helpers for a small synthetic corpus and model."""

from __future__ import annotations

from pathlib import Path

from preempt.model.tiny import TinyConfig

# 2 layers x 2 KV heads x 2 query heads each: every code path of the real LM, in milliseconds.
TEST_ARCH = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
}
TEST_CONFIG = TinyConfig(vocab_size=256, **TEST_ARCH)

_TEMPLATE = '''"""Module {i}: generated for the tests."""

import os


def function_{i}(value, count={i}):
    """Return value repeated count times."""
    result = []
    for index in range(count):
        if index % 2 == 0:
            result.append(value)
        else:
            result.append(str(value))
    return result


class Thing{i}:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Thing{i}({{self.name!r}})"
'''


def write_corpus(root: Path, num_files: int = 40) -> Path:
    """A directory of small, repetitive Python files (plus a tests/ dir that must be skipped)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        package = root / f"pkg{i % 4}"
        package.mkdir(exist_ok=True)
        (package / f"mod_{i}.py").write_text(_TEMPLATE.format(i=i))
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_skipped.py").write_text("SKIPPED = True\n")
    return root
