"""Property-based bad input: whatever the body, the gateway answers below 500, errors in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import Gateway

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(strategy, strategy, json_values)


contents = st.one_of(
    st.text(max_size=40),
    st.lists(st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(st.text(max_size=20))}), max_size=3),
    json_values,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]))},
        optional={
            "content": contents,
            "tool_call_id": maybe(st.text(max_size=8)),
            "tool_calls": json_values,
            "name": json_values,
        },
    ),
    max_size=4,
)


def valid_messages() -> st.SearchStrategy[list[dict[str, Any]]]:
    text = st.text(max_size=30)
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
        st.fixed_dictionaries(
            {
                "role": st.just("user"),
                "content": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
            }
        ),
        st.fixed_dictionaries({"role": st.just("tool"), "content": text, "tool_call_id": st.text(max_size=5)}),
    )
    return st.lists(message, min_size=1, max_size=3)


def chat_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid request (small completion budget, so it is quick to answer) with a few fields mutated."""
    valid = st.fixed_dictionaries(
        {"model": st.just(model), "messages": valid_messages(), "max_tokens": st.integers(1, 4)},
        optional={
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "n": st.integers(1, 3),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0, 1),
            "top_k": st.integers(-1, 50),
            "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
            "seed": st.integers(-(2**63), 2**63 - 1),
            "logprobs": st.booleans(),
            "user": st.text(max_size=20),
            "metadata": st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4),
        },
    )
    mutations = st.fixed_dictionaries(
        {},
        optional={
            "model": maybe(st.sampled_from(["other-model", ""])),
            "messages": maybe(messages),
            "max_tokens": maybe(st.integers(-2, 3000)),
            "max_completion_tokens": maybe(st.integers(-2, 3000)),
            "stream": json_values,
            "stream_options": json_values,
            "n": maybe(st.integers(-1, 20)),
            "temperature": maybe(st.floats(-1, 3) | st.just(float("nan")) | st.just(float("inf"))),
            "top_p": maybe(st.floats(-0.5, 1.5)),
            "top_k": maybe(st.integers(-3, 100)),
            "stop": maybe(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6)),
            "seed": maybe(st.integers(-(2**65), 2**65)),
            "logprobs": json_values,
            "top_logprobs": maybe(st.integers(-2, 25)),
            "user": maybe(st.text(max_size=300)),
            "metadata": maybe(st.dictionaries(st.text(max_size=70), maybe(st.text(max_size=600)), max_size=18)),
        },
    )
    return st.builds(lambda base, changes: {**base, **changes}, valid, mutations)


def feedback_bodies(completion_id: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "completion_id": maybe(st.sampled_from([completion_id, "chatcmpl-unknown"]) | st.text(max_size=140)),
            "rating": maybe(st.sampled_from(["up", "down", "meh"])),
            "score": maybe(st.floats(-2, 2) | st.just(float("nan"))),
            "choice_index": maybe(st.integers(-2, 20)),
            "comment": maybe(st.text(max_size=20)),
            "corrected_answer": maybe(st.text(max_size=20)),
        },
    )


@pytest.fixture(scope="module")
def http(gateway: Gateway) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}", "Content-Type": "application/json"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client:
        yield client


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    event(f"status {response.status_code}")
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def post(http: httpx.Client, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    # json.dumps, unlike orjson, writes NaN and Infinity, which Python's JSON parser accepts.
    return http.post(path, content=json.dumps(body).encode(), headers=headers)


@FUZZ
@given(data=st.data())
def test_chat_completions_never_5xx(http: httpx.Client, gateway: Gateway, data: st.DataObject) -> None:
    body = data.draw(chat_bodies(gateway.model))
    # Header values cannot start or end with whitespace (HTTP itself, checked by the client library).
    header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300).filter(
        lambda s: s == s.strip()
    )
    session = data.draw(st.none() | header_text)
    response = post(http, "/v1/chat/completions", body, headers={"X-Session-Id": session} if session else None)
    check(response)
    if response.status_code == 200 and body.get("stream") is True:
        assert response.text.endswith("data: [DONE]\n\n")


@pytest.fixture(scope="module")
def completion_id(http: httpx.Client, gateway: Gateway) -> str:
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return http.post("/v1/chat/completions", json=body).json()["id"]


@FUZZ
@given(data=st.data())
def test_feedback_never_5xx(http: httpx.Client, completion_id: str, data: st.DataObject) -> None:
    check(post(http, "/v1/feedback", data.draw(feedback_bodies(completion_id) | json_values)))


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/chat/completions", "/v1/feedback"]))
def test_raw_bytes_never_5xx(http: httpx.Client, raw: bytes, path: str) -> None:
    check(http.post(path, content=raw))


@settings(max_examples=60, deadline=None)
@given(completion_id=st.text(st.characters(codec="utf-8"), min_size=1, max_size=80))
def test_completion_lookup_never_5xx(http: httpx.Client, completion_id: str) -> None:
    check(http.get(f"/v1/completions/{quote(completion_id, safe='')}"))
