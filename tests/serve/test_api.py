"""The OpenAI routes through the official `openai` client, and `/generate`."""

from __future__ import annotations

import httpx
import openai

from tests.serve.conftest import AUTH, LiveServer, sse_events


# ------------------------------------------------------------------------------ OpenAI API
def test_openai_completion_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny-2l", prompt="Hello, world", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.model == "tiny-2l"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(b"Hello, world") and whole.usage.completion_tokens == 12

    chunks = list(
        client.completions.create(
            model="tiny-2l",
            prompt="Hello, world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # greedy: same bytes, same (incremental) decoding
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_openai_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model="tiny-2l", messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model="tiny-2l", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_sampling_and_sla_level_extension(client: openai.OpenAI) -> None:
    # temperature defaults to OpenAI's 1.0 (sampled, seeded per request); sla_level rides
    # in extra_body.
    out = client.completions.create(model="tiny-2l", prompt="abc", max_tokens=5, extra_body={"sla_level": 3})
    assert out.usage.completion_tokens == 5
    assert [m.id for m in client.models.list().data] == ["tiny-2l"]


def test_generate_whole_and_streamed(live: LiveServer) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 9, "sla_level": 1}
    whole = httpx.post(f"{live.url}/generate", json=body, headers=AUTH, timeout=30).json()
    assert whole["final_state"] == "FINISHED" and len(whole["token_ids"]) == 9
    assert whole["usage"]["prompt_tokens"] == len(body["prompt"]) and whole["ttft_s"] > 0
    with httpx.stream(
        "POST", f"{live.url}/generate", json={**body, "stream": True}, headers=AUTH, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "length"
    assert [t for e in events[:-1] for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in events[:-1]) == whole["text"]
