"""Golden runs stay byte-identical (tests/golden/__init__.py says how to regenerate them
when a change is meant to alter behaviour)."""

from __future__ import annotations

import json

import pytest

from tests.golden import CASES, golden_path, run_case


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_run_is_unchanged(name):
    expected = json.loads(golden_path(name).read_text())
    actual = json.loads(json.dumps(run_case(name), sort_keys=True))
    assert actual["summary"] == expected["summary"]
    assert len(actual["requests"]) == len(expected["requests"])
    for got, want in zip(actual["requests"], expected["requests"], strict=True):
        assert got == want, f"request {want['request_id']} changed"
    assert actual["preemptions"] == expected["preemptions"]
