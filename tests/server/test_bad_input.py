"""Bad input is the client's fault, never a database outage: NUL characters and out-of-range integers
in paths, queries and bodies answer 400 or 404, on SQLite and PostgreSQL (which refuses both)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

TENANT = f"acme-{uuid.uuid4().hex[:8]}"  # the PostgreSQL database is shared by the test session
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

ADMIN_REQUESTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/admin/keys?tenant=a%00b", None),
    ("GET", "/admin/tenants/a%00b", None),
    ("GET", "/admin/runs/r%00", None),
    ("GET", "/admin/models/v%00", None),
    ("GET", "/admin/schedules/s%00", None),
    ("GET", "/admin/keys/key_%00", None),
    ("GET", "/admin/stats/ratings?model=%00", None),
    ("GET", "/admin/runs?model=a%00", None),
    ("GET", "/admin/models?model=a%00", None),
    ("GET", "/admin/users/bob/data?tenant=a%00", None),
    ("DELETE", "/admin/users/bob/data?tenant=a%00", None),
    ("POST", "/admin/keys", {"tenant": "a\u0000b"}),
    ("GET", "/admin/audit?before=99999999999999999999", None),
    ("GET", "/admin/audit?before=9223372036854775808", None),
]
TENANT_REQUESTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/completions/abc%00", None),
    ("POST", "/v1/feedback", {"completion_id": "a\u0000b", "rating": "up"}),
]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    database = {"database_url": request.getfixturevalue("postgres_url")} if request.param == "postgres" else {}
    settings = gateway_settings(
        tmp_path_factory.mktemp("bad-input"), tiny_model_path(), admin_key=ADMIN_KEY, **database
    )
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def send(
    gateway: Gateway, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]
) -> httpx.Response:
    # The path goes out as written: httpx must not re-encode %00.
    url = httpx.URL(gateway.url + path.split("?")[0], query=path.partition("?")[2].encode())
    return httpx.request(method, url, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_REQUESTS + TENANT_REQUESTS)
def test_bad_ids_and_numbers_are_400_or_404(
    gateway: Gateway, method: str, path: str, body: dict[str, Any] | None
) -> None:
    headers = ADMIN if path.startswith("/admin") else {"Authorization": f"Bearer {gateway.keys[TENANT]}"}
    response = send(gateway, method, path, body, headers)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["code"] != "database_unavailable"


@pytest.mark.parametrize("path", ["/admin/runs/a%00b", "/admin/keys?tenant=a%00b"])
def test_nul_in_the_url_names_the_parameter(gateway: Gateway, path: str) -> None:
    error = send(gateway, "GET", path, None, ADMIN).json()["error"]
    assert error["code"] == "invalid_request"
    assert "NUL" in error["message"]


def test_an_end_user_id_may_hold_nul(gateway: Gateway) -> None:
    # Chat requests' `user` is stored NUL-safe, so its data can be looked up by it.
    response = send(gateway, "GET", f"/admin/users/a%00b/data?tenant={TENANT}", None, ADMIN)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "user_not_found"
