"""Parts the gateway cannot honour (images, audio, files) answer one clear 400 rather than being
ignored; the forms of tool and format fields that change nothing are accepted (tests/server/test_tools.py
has tools and structured output themselves)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import Gateway


def chat(gateway: Gateway, **fields: Any) -> httpx.Response:
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"tools": None},
        {"tools": []},
        {"function_call": "none"},
    ],
)
def test_fields_that_change_nothing_are_accepted(gateway: Gateway, fields: dict[str, Any]) -> None:
    response = chat(gateway, **fields)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
    ids=lambda part: part["type"],
)
def test_a_non_text_content_part_is_one_clear_400(gateway: Gateway, part: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    response = chat(gateway, messages=messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.user.content", error
    assert "this model takes text only" in error["message"] and repr(part["type"]) in error["message"]
    assert "more problems" not in error["message"]  # one error, not the union's list


def test_text_parts_are_read(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi."}]}]
    assert chat(gateway, messages=messages).status_code == 200
