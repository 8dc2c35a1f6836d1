"""What every route answers before its handler runs: 401 before a bad body's 400, and 405 with the
methods the path does support."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from tandem.logging import REQUEST_LOGGER
from tests.server.conftest import ADMIN_KEY, Gateway
from tests.support.polling import wait_until

BAD_BODIES: list[tuple[str, Any]] = [
    ("/admin/keys", {"tenant": 5}),
    ("/admin/keys", "not json{"),
    ("/admin/weights", {}),
    ("/v1/feedback", {"completion_id": "x"}),
    ("/v1/feedback", "not json{"),
    ("/v1/chat/completions", {"messages": []}),
    ("/admin/runs/r%00/cancel", None),
]


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    if isinstance(body, str):
        headers = {"Content-Type": "application/json", **(headers or {})}
        return httpx.post(url, content=body, headers=headers, timeout=30)
    return httpx.post(url, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
def test_unauthenticated_bad_requests_are_401(gateway: Gateway, path: str, body: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        response = post(gateway.url + path, body, headers)
        assert response.status_code == 401, response.text


@pytest.mark.parametrize(("path", "body"), [item for item in BAD_BODIES if item[0].startswith("/admin/")])
def test_a_tenant_key_on_an_admin_route_with_a_bad_body_is_403(gateway: Gateway, path: str, body: Any) -> None:
    response = post(gateway.url + path, body, {"Authorization": f"Bearer {gateway.keys['acme']}"})
    assert response.status_code == 403, response.text


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
def test_authenticated_bad_requests_are_still_400(gateway: Gateway, path: str, body: Any) -> None:
    key = ADMIN_KEY if path.startswith("/admin/") else gateway.keys["acme"]
    response = post(gateway.url + path, body, {"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"


def test_keyless_loopback_bad_bodies_are_400(keyless_gateway: Gateway) -> None:
    response = post(keyless_gateway.url + "/v1/feedback", {"completion_id": "x"})
    assert response.status_code == 400, response.text


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/admin/engines/local-0/drain", {"GET", "POST"}),  # GET: a replica named local-0/drain
        ("PUT", "/admin/keys", {"GET", "POST"}),
        ("PATCH", "/admin/keys/key_x", {"GET", "DELETE"}),
        ("DELETE", "/admin/schedules", {"GET", "POST"}),
        ("PUT", "/admin/schedules/s1", {"GET", "PATCH", "DELETE"}),
        ("GET", "/v1/feedback", {"POST"}),
        ("PUT", "/admin/users/bob/data", {"GET", "DELETE"}),
    ],
)
def test_405_allows_every_method_of_the_path(gateway: Gateway, method: str, path: str, allowed: set[str]) -> None:
    response = httpx.request(method, gateway.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 405, response.text
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "application/json; charset=utf-8"],
    ids=["none", "curl -d's form label", "json"],
)
def test_a_json_body_is_read_whatever_its_content_type_says(gateway: Gateway, content_type: str | None) -> None:
    """`curl -d '{...}'` without -H 'Content-Type: application/json' works as the docs' examples do."""
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = f'{{"model": "{gateway.model}", "messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 1}}'
    request = httpx.Request("POST", f"{gateway.url}/v1/chat/completions", content=body.encode(), headers=headers)
    assert request.headers.get("Content-Type") == content_type  # httpx adds none for raw bytes
    response = httpx.Client(timeout=60).send(request)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


def test_a_body_declared_as_something_else_is_still_refused(gateway: Gateway) -> None:
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}", "Content-Type": "text/plain"}
    response = httpx.post(
        f"{gateway.url}/v1/feedback", content=b'{"completion_id": "x", "rating": "up"}', headers=headers, timeout=30
    )
    assert response.status_code == 400, response.text


def test_polled_reads_are_debug_lines_and_the_rest_info(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    """The learner reads /admin/weights every few seconds: at INFO it was a third of the log."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with caplog.at_level(logging.DEBUG, logger=REQUEST_LOGGER):
        assert httpx.get(f"{gateway.url}/admin/weights", headers=admin, timeout=30).status_code == 200
        assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{gateway.url}/admin/weights", timeout=30).status_code == 401
        assert httpx.get(f"{gateway.url}/admin/engines", headers=admin, timeout=30).status_code == 200
        wait_until(lambda: len(_request_lines(caplog)) >= 4, timeout_s=10, what="the four request lines")
    levels = {(r.path, r.status): r.levelname for r in _request_lines(caplog)}  # type: ignore[attr-defined]
    assert levels[("/admin/weights", 200)] == "DEBUG" and levels[("/health", 200)] == "DEBUG"
    assert levels[("/admin/weights", 401)] == "INFO"  # a refused read is worth seeing
    assert levels[("/admin/engines", 200)] == "INFO"


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == REQUEST_LOGGER]
