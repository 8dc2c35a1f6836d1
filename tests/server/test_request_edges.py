"""What every route answers before its handler runs: 401 before a bad body's 400, and 405 with the
methods the path does support."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, Gateway

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
