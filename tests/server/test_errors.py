"""Every error status of the API, in OpenAI's shape, seen through the openai client's exceptions."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from server.app import ServingUnprotectedError, create_app
from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from tests.server.conftest import ADMIN_KEY, TEST_BODY_LIMIT, Gateway, create_keys, gateway_settings, run_gateway
from tests.support.uvicorn_thread import serve_in_thread

HELLO = [{"role": "user", "content": "hi"}]


def assert_openai_shape(exc: openai.APIStatusError, status: int) -> dict[str, Any]:
    assert exc.status_code == status
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def raw_post(gateway: Gateway, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}", **kwargs.pop("headers", {})}
    return httpx.post(f"{gateway.url}{path}", headers=headers, timeout=30, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0"),
        ({"messages": [{"role": "user"}]}, "messages.0.user.content"),
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
def test_bad_parameters_are_400(client: OpenAI, gateway: Gateway, overrides: dict[str, Any], param: str | None) -> None:
    body = {"model": gateway.model, "messages": HELLO, "max_tokens": 2, **overrides}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = assert_openai_shape(caught.value, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


def test_prompt_longer_than_the_context_names_both_numbers(client: OpenAI, gateway: Gateway) -> None:
    long = " ".join(f"word{i}" for i in range(3000))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": long}])
    error = assert_openai_shape(caught.value, 400)
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"]
    prompt_tokens = int(error["message"].split("resulted in ")[1].split()[0])
    assert prompt_tokens > 2048


def test_max_tokens_beyond_the_context_names_the_numbers(client: OpenAI, gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2048)
    error = assert_openai_shape(caught.value, 400)
    assert "2048" in error["message"] and "in the completion" in error["message"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"text"', b"", b"\xff\xfe"])
def test_invalid_json_is_400(gateway: Gateway, body: bytes) -> None:
    response = raw_post(gateway, "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def _with_extra(gateway: Gateway, extra: str) -> bytes:
    return f'{{"model": "{gateway.model}", "messages": [{{"role": "user", "content": "hi"}}], "x": {extra}}}'.encode()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            lambda g: b"{not json",
            "it is not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        ),
        (lambda g: _with_extra(g, '"h"').replace(b'"h"', b'"h\xff"'), "is not valid UTF-8: byte 0xff"),
        (lambda g: _with_extra(g, "[" * 5000 + "]" * 5000), "nests arrays or objects too deeply"),
        (lambda g: _with_extra(g, "9" * 5000), "a number in the json body of your request has too many digits"),
    ],
    ids=["syntax", "utf-8", "depth", "digits"],
)
def test_a_body_that_cannot_be_parsed_says_why(gateway: Gateway, body: Any, says: str) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {gateway.keys['acme']}"}
    response = raw_post(gateway, "/v1/chat/completions", content=body(gateway), headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says.lower() in error["message"].lower() and error["type"] == "invalid_request_error"


def test_missing_and_wrong_keys_are_401(gateway: Gateway) -> None:
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": gateway.model, "messages": HELLO})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as caught:
        gateway.client("tdm-not-a-key").chat.completions.create(model=gateway.model, messages=HELLO)
    assert_openai_shape(caught.value, 401)
    with pytest.raises(openai.AuthenticationError):
        gateway.client("tdm-not-a-key").models.list()


def test_unknown_model_completion_and_route_are_404(client: OpenAI, gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    error = assert_openai_shape(caught.value, 404)
    assert error["code"] == "model_not_found" and gateway.model in error["message"]
    response = httpx.get(
        f"{gateway.url}/v1/completions/chatcmpl-missing", headers={"Authorization": f"Bearer {gateway.keys['acme']}"}
    )
    assert response.status_code == 404 and response.json()["error"]["param"] == "completion_id"
    assert raw_post(gateway, "/v1/nothing-here", json={}).status_code == 404


def test_oversized_bodies_are_413(gateway: Gateway) -> None:
    big = {"model": gateway.model, "messages": [{"role": "user", "content": "x" * TEST_BODY_LIMIT}]}
    declared = raw_post(gateway, "/v1/chat/completions", json=big)
    assert declared.status_code == 413
    assert str(TEST_BODY_LIMIT) in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is what counts
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(TEST_BODY_LIMIT // 4096 + 1):
            yield b"x" * 4096
        yield b'"}]}'

    streamed = raw_post(gateway, "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    assert set(streamed.json()["error"]) == {"message", "type", "param", "code"}


def test_full_engine_queue_is_429(keyless_gateway: Gateway) -> None:
    client = keyless_gateway.client()
    running = client.chat.completions.create(
        model=keyless_gateway.model, messages=HELLO, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        next(iter(running))
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=keyless_gateway.model, messages=HELLO, max_tokens=2)
        assert_openai_shape(caught.value, 429)
        assert caught.value.response.headers.get("retry-after") == "1"
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=keyless_gateway.model, messages=HELLO, max_tokens=2, stream=True)
    finally:
        running.close()


def test_unreachable_engine_is_503(tiny_model: Path, tmp_path: Path) -> None:
    engine_server = serve_in_thread(
        create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=2))
    )
    engine_url = engine_server.__enter__()
    running = True
    try:
        settings = gateway_settings(tmp_path, tiny_model, engine="sglang", engine_urls=[engine_url])
        with run_gateway(settings) as gateway:
            client = gateway.client()
            assert client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2).choices
            engine_server.__exit__(None, None, None)
            running = False
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as caught:
                    client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2, stream=stream)
                assert assert_openai_shape(caught.value, 503)["type"] == "service_unavailable"
            assert httpx.get(f"{gateway.url}/health").status_code == 503
    finally:
        if running:
            engine_server.__exit__(None, None, None)


def test_non_loopback_without_keys_refuses_to_start(tiny_model: Path, tmp_path: Path) -> None:
    open_bind = gateway_settings(tmp_path, tiny_model, host="0.0.0.0")
    with pytest.raises(ServingUnprotectedError, match=r"0\.0\.0\.0.*no API key"):
        create_app(open_bind)
    create_app(gateway_settings(tmp_path, tiny_model, host="0.0.0.0", admin_key=ADMIN_KEY))
    create_keys(open_bind.resolved_database_url, ("acme",))
    create_app(open_bind)


def test_an_empty_admin_key_is_refused_with_the_setting_named(tmp_path: Path) -> None:
    """`TANDEM_ADMIN_KEY=` with a public bind used to skip the unprotected-bind check and start."""
    env = {**os.environ, "TANDEM_ADMIN_KEY": "", "TANDEM_HOST": "0.0.0.0", "TANDEM_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "TANDEM_ADMIN_KEY is set but empty" in done.stderr
