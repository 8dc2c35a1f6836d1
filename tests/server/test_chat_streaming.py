"""Streaming chat completions: OpenAI's chunk sequence, usage chunk, stop strings, n > 1."""

from __future__ import annotations

import httpx
import orjson
from openai import OpenAI

from tests.server.conftest import Gateway

HELLO = [{"role": "user", "content": "Write a line of code."}]


def test_stream_matches_the_non_streamed_reply(client: OpenAI, gateway: Gateway) -> None:
    whole = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=gateway.model,
            messages=HELLO,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None for c in middle)
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in middle) == whole.choices[0].message.content
    assert usage.choices == []
    assert usage.usage is not None and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens_details is not None


def test_stream_without_usage_has_no_usage_chunk(client: OpenAI, gateway: Gateway) -> None:
    chunks = list(client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=3, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_raw_sse_ends_with_done(gateway: Gateway) -> None:
    body = {"model": gateway.model, "messages": HELLO, "max_tokens": 3, "stream": True}
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert orjson.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_stop_string_never_leaks(client: OpenAI, gateway: Gateway) -> None:
    whole = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content or ""
    start = next(i for i in range(len(text) // 3, len(text) - 4) if text[i : i + 4].isascii())
    stop = text[start : start + 4]
    stream = client.chat.completions.create(
        model=gateway.model, messages=HELLO, max_tokens=24, temperature=0, stream=True, stop=stop
    )
    deltas = []
    finish = None
    for chunk in stream:
        deltas.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(deltas) == text[: text.index(stop)]
    assert finish == "stop"


def test_stream_n_choices_and_logprobs(client: OpenAI, gateway: Gateway) -> None:
    stream = client.chat.completions.create(
        model=gateway.model,
        messages=HELLO,
        max_tokens=6,
        n=2,
        seed=3,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    tokens = {0: 0, 1: 0}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            tokens[choice.index] += len(choice.logprobs.content)
            assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1}
    assert usage is not None and usage.completion_tokens == tokens[0] + tokens[1]
