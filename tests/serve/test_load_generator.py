"""A real load generator against `preempt serve`: guidellm (the `load` extra) sweeping two
constant rates over loopback, through `preempt.bench.load`, the code `preempt bench serve`
runs. Skipped without guidellm, except where PREEMPT_REQUIRE_LOADGEN=1 (CI) turns that
skip into a failure."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from preempt.bench.load import INSTALL_HINT, guidellm_installed, run_guidellm, summarize
from preempt.model.tokenizer import ByteTokenizer, write_byte_tokenizer
from tests.serve.conftest import running_server, serve_config

NUM_REQUESTS = 12
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
RATES = (8.0, 32.0)


def require_guidellm() -> None:
    if guidellm_installed():
        return
    message = f"guidellm is not installed ({INSTALL_HINT})"
    if os.environ.get("PREEMPT_REQUIRE_LOADGEN") == "1":
        pytest.fail(f"PREEMPT_REQUIRE_LOADGEN=1 but {message}")
    pytest.skip(message)


@pytest.mark.parametrize("written_by", ["function", "cli"])
def test_byte_tokenizer_file_is_the_servers_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_by: str
) -> None:
    """Loaded the way guidellm loads it (AutoTokenizer on a local directory, offline), the
    file maps text to the byte ids the tiny backend uses, and any ids back to its text;
    `preempt tokenizer --out DIR` (the serving docs' first command) writes the same."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if written_by == "cli":
        from preempt.cli import main

        assert main(["tokenizer", "--out", str(tmp_path / "tok")]) == 0
        directory = tmp_path / "tok"
    else:
        directory = write_byte_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    byte = ByteTokenizer()
    assert len(tokenizer) == byte.vocab_size
    assert tokenizer.all_special_ids == []
    for text in ["Hello, world!", "  two  spaces\tand\ttabs\n", "héllo ✓ 日本語 🙂", "", "a" * 300]:
        assert tokenizer.encode(text, add_special_tokens=False) == byte.encode(text)
    rng = random.Random(0)
    for _ in range(100):  # any ids, valid UTF-8 or not
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        assert tokenizer.decode(ids) == byte.decode(ids)


def test_guidellm_sweep_against_preempt_serve_has_no_errors(tmp_path: Path) -> None:
    require_guidellm()
    config = serve_config(scheduler={"max_num_seqs": 8})
    with running_server(config) as live:
        runs = run_guidellm(
            live.url,
            tmp_path,
            RATES,
            NUM_REQUESTS,
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            max_seconds_per_rate=20.0,
        )
        free_blocks, num_blocks, free_slots, num_slots = live.resources()
    assert [run.rate for run in runs] == list(RATES)
    for run in runs:
        assert (run.num_errored, run.num_incomplete, len(run.timings)) == (0, 0, NUM_REQUESTS)
        # Token counts agree on both sides: guidellm built PROMPT_TOKENS-token prompts with
        # the tokenizer file, and the server counted the same (its usage.prompt_tokens).
        assert run.num_prompt_tokens == [PROMPT_TOKENS] * NUM_REQUESTS
        assert [len(prompt.encode("utf-8")) for prompt in run.prompts] == [PROMPT_TOKENS] * NUM_REQUESTS
        assert [t.num_output_tokens for t in run.timings] == [OUTPUT_TOKENS] * NUM_REQUESTS
        assert all(t.start_s < t.first_token_s <= t.last_token_s for t in run.timings)
        summary = summarize(run.timings)
        assert summary["num_requests"] == NUM_REQUESTS
        assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
        assert summary["itl_ms"]["p50"] > 0
    # Every request ended and freed what it held.
    assert (free_blocks, free_slots) == (num_blocks, num_slots)
