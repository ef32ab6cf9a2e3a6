"""preempt.engine.sampling: vLLM's logits processing semantics, top-k/p restriction, seeded draws,
and stop strings found across any chunking of the text (property test)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preempt.engine.sampling import (
    SamplingParams,
    StopStringMatcher,
    logprobs_of,
    process_logits,
    sample_token,
)


def test_penalties_bias_and_min_tokens_follow_vllm() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((2, 1.0),),
        min_tokens=3,
        stop_token_ids=frozenset({3}),
    )
    out = process_logits(logits, params, prompt_ids=[1], output_ids=[0, 0])
    # token 0: seen (output) -> 2/2 = 1, minus 0.5 * 2 + 0.25 = 1.25 -> -0.25
    # token 1: seen (prompt only) -> -1 * 2 = -2, no output penalties
    # token 2: unseen, +1 bias -> 1.5; token 3: stop token before min_tokens -> -inf
    assert out[:3].tolist() == pytest.approx([-0.25, -2.0, 1.5]) and out[3] == -math.inf
    later = process_logits(logits, params, prompt_ids=[1], output_ids=[0, 0, 2])
    assert later[3] == 3.0  # min_tokens reached: the stop token is allowed again
    assert params.stops_at(3, 3) and not params.stops_at(3, 2) and not params.stops_at(1, 5)


def test_neutral_params_are_plain() -> None:
    assert SamplingParams(temperature=0.7).is_plain
    assert not SamplingParams(seed=1).is_plain and not SamplingParams(num_logprobs=0).is_plain
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_top_k_and_top_p_restrict_the_draw_and_seeds_repeat() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0])
    draws_k = {sample_token(logits, 5.0, seed, top_k=2) for seed in range(300)}
    assert draws_k == {0, 1}
    probs = torch.softmax(logits / 5.0, dim=0)
    assert probs[0] < 0.5  # so top_p=0.5 must keep two tokens
    draws_p = {sample_token(logits, 5.0, seed, top_p=0.5) for seed in range(300)}
    assert draws_p == {0, 1}
    assert [sample_token(logits, 1.0, s) for s in range(50)] == [
        sample_token(logits, 1.0, s) for s in range(50)
    ]


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([1.0, 2.0, 0.0])
    sample = logprobs_of(logits, 0, 2)
    logp = torch.log_softmax(logits.double(), 0)
    assert sample.logprob == pytest.approx(float(logp[0]))
    assert [t for t, _ in sample.top_logprobs] == [1, 0]


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=40),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
def test_stop_strings_across_any_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    """Whatever the chunking, the emitted text is the text up to the first stop string."""
    matcher = StopStringMatcher(stops)
    pieces, at = [], 0
    for size in cuts:
        pieces.append(text[at : at + size])
        at += size
    pieces.append(text[at:])
    out = "".join(matcher.push(piece) for piece in pieces) + matcher.close()
    firsts = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(firsts)] if firsts else text
    assert out == expected and matcher.is_stopped == bool(firsts)


def test_a_longer_stop_that_started_first_wins_over_a_shorter_later_one():
    # Found by the property test above: "babb" starts at 2 and completes only after "a" (at
    # 3) is complete; the output must stop at 2.
    matcher = StopStringMatcher(["a", "babb", "cb\n"])
    out = "".join(matcher.push(p) for p in ["c\nb", "ab", "b", "\nb"]) + matcher.close()
    assert out == "c\n" and matcher.matched == "babb"
    # ... and when the longer one never completes, the shorter one still stops the text.
    matcher = StopStringMatcher(["c", "aca"])
    assert matcher.push("ac") == ""  # "c" matched, but "aca" may start at 0: hold
    assert matcher.push("a") == "" and matcher.matched == "aca"
    matcher = StopStringMatcher(["c", "acab"])
    out = matcher.push("ac") + matcher.push("a") + matcher.close()
    assert out == "a" and matcher.matched == "c"
