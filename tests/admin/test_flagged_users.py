"""/admin/users/{user}/flag and /admin/flagged-users on a live gateway (tiny model; SQLite and
PostgreSQL): flag, reflag, list, unflag, the audit log, and the errors."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
import torch

from storage.audit import list_admin_actions
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACTOR = "admin:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12]
TENANT = f"flags-{uuid.uuid4().hex[:8]}"  # the PostgreSQL database is shared by the test session


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    database = {"database_url": request.getfixturevalue("postgres_url")} if request.param == "postgres" else {}
    settings = gateway_settings(tmp_path_factory.mktemp("flags"), tiny_model_path(), admin_key=ADMIN_KEY, **database)
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def flag(gateway: Gateway, method: str, user: str, tenant: str = TENANT, **body: object) -> httpx.Response:
    url = f"{gateway.url}/admin/users/{quote(user, safe='')}/flag"
    return httpx.request(method, url, headers=ADMIN, params={"tenant": tenant}, json=body if method == "PUT" else None)


def flagged(gateway: Gateway) -> list[dict[str, object]]:
    response = httpx.get(f"{gateway.url}/admin/flagged-users", headers=ADMIN, params={"tenant": TENANT})
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_flag_reflag_list_and_unflag_are_audited(gateway: Gateway) -> None:
    user = "mallory/with a slash"
    first = flag(gateway, "PUT", user, reason="rates everything up")
    assert first.status_code == 200, first.text
    assert first.json() | {"flagged_at": None} == {
        "object": "flagged_user",
        "tenant_id": TENANT,
        "user": user,
        "reason": "rates everything up",
        "flagged_by": ACTOR,
        "flagged_at": None,
    }
    again = flag(gateway, "PUT", user, reason="still at it").json()
    assert [(f["user"], f["reason"]) for f in flagged(gateway)] == [(user, "still at it")]
    assert again["flagged_at"] >= first.json()["flagged_at"]
    removed = flag(gateway, "DELETE", user)
    assert removed.status_code == 200 and removed.json()["reason"] == "still at it"
    assert flagged(gateway) == []
    gone = flag(gateway, "DELETE", user)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_flagged"
    with gateway.sessions()() as session:
        actions = [(a.action, a.status_code) for a in list_admin_actions(session, limit=1000) if a.target == user]
    assert sorted(actions) == [("user.flag", 200), ("user.flag", 200), ("user.unflag", 200), ("user.unflag", 404)]


def test_an_unknown_tenant_or_a_missing_admin_key_is_refused(gateway: Gateway) -> None:
    assert flag(gateway, "PUT", "bob", tenant="no-such-tenant").status_code == 404
    url = f"{gateway.url}/admin/users/bob/flag"
    assert httpx.put(url, params={"tenant": TENANT}, json={}).status_code == 401
    too_long = flag(gateway, "PUT", "bob", reason="x" * 2001)
    assert too_long.status_code == 400
