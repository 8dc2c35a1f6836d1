"""/admin/tenants and /admin/keys on a live gateway (local engine, tiny model, SQLite): a key works
the moment it is created and is refused the moment it is revoked; its secret is shown once."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest
import torch

from storage.audit import list_admin_actions
from storage.models import ApiKey
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("keys"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def admin(gateway: Gateway, method: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, **kwargs)  # type: ignore[arg-type]


def chat_status(gateway: Gateway, key: str) -> int:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": gateway.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    return response.status_code


def audit_actions(gateway: Gateway) -> list[tuple[str, str | None, int]]:
    with gateway.sessions()() as session:
        return [(a.action, a.target, a.status_code) for a in list_admin_actions(session, limit=1000)]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/tenants"),
        ("POST", "/admin/tenants"),
        ("GET", "/admin/tenants/acme"),
        ("POST", "/admin/tenants/acme/revoke"),
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("GET", "/admin/keys/key_x"),
        ("DELETE", "/admin/keys/key_x"),
    ],
)
def test_needs_the_admin_key(gateway: Gateway, method: str, path: str) -> None:
    missing = httpx.request(method, f"{gateway.url}{path}", json={"id": "t", "tenant": "acme"})
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    tenant_key = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    forbidden = httpx.request(method, f"{gateway.url}{path}", json={"id": "t", "tenant": "acme"}, headers=tenant_key)
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "admin_required"


def test_key_lifecycle(gateway: Gateway) -> None:
    created = admin(gateway, "POST", "/admin/tenants", json={"id": "initech", "name": "Initech"})
    assert created.status_code == 201, created.text
    assert created.json() | {"created_at": None} == {
        "id": "initech",
        "name": "Initech",
        "created_at": None,
        "active_keys": 0,
    }

    response = admin(gateway, "POST", "/admin/keys", json={"tenant": "initech", "name": "ci"})
    assert response.status_code == 201, response.text
    key = response.json()
    secret = key.pop("key")
    assert secret.startswith("tdm-") and len(secret) > 40
    assert key["tenant_id"] == "initech" and key["name"] == "ci" and key["revoked_at"] is None
    assert key["hint"] == secret[:8] + "…"
    assert chat_status(gateway, secret) == 200  # usable at once

    shown = admin(gateway, "GET", f"/admin/keys/{key['id']}").json()
    listed = admin(gateway, "GET", "/admin/keys", params={"tenant": "initech"}).json()["data"]
    assert listed == [shown] == [key | {"last_used_at": shown["last_used_at"]}]
    everything = admin(gateway, "GET", "/admin/keys").text + admin(gateway, "GET", "/admin/tenants").text
    assert secret[8:] not in everything and secret[8:12] not in everything  # never shown again
    with gateway.sessions()() as session:  # stored as its SHA-256 and an 8-character prefix only
        row = session.get(ApiKey, key["id"])
        assert row is not None and row.key_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert secret not in str([getattr(row, c.key) for c in ApiKey.__table__.columns])
    tenants = {t["id"]: t for t in admin(gateway, "GET", "/admin/tenants").json()["data"]}
    assert tenants["initech"]["active_keys"] == 1 and tenants["acme"]["active_keys"] == 1

    revoked = admin(gateway, "DELETE", f"/admin/keys/{key['id']}")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    assert chat_status(gateway, secret) == 401  # at once, not after the auth cache expires
    again = admin(gateway, "DELETE", f"/admin/keys/{key['id']}")
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]  # idempotent: the first time stays

    actions = audit_actions(gateway)
    assert ("tenant.create", "initech", 201) in actions
    assert ("key.create", "initech", 201) in actions
    assert actions.count(("key.revoke", key["id"], 200)) == 2


def test_revoking_a_tenant_revokes_all_its_keys(gateway: Gateway) -> None:
    assert admin(gateway, "POST", "/admin/tenants", json={"id": "hooli"}).status_code == 201
    created = [admin(gateway, "POST", "/admin/keys", json={"tenant": "hooli"}) for _ in range(2)]
    assert [c.status_code for c in created] == [201, 201], created[-1].text
    secrets = [c.json()["key"] for c in created]
    assert [chat_status(gateway, s) for s in secrets] == [200, 200]
    response = admin(gateway, "POST", "/admin/tenants/hooli/revoke")
    assert response.status_code == 200
    assert len(response.json()["revoked_keys"]) == 2 and response.json()["active_keys"] == 0
    assert [chat_status(gateway, s) for s in secrets] == [401, 401]
    assert chat_status(gateway, gateway.keys["acme"]) == 200  # other tenants keep theirs
    assert admin(gateway, "GET", "/admin/tenants/hooli").json()["active_keys"] == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "code"),
    [
        ("GET", "/admin/tenants/nobody", None, "tenant_not_found"),
        ("POST", "/admin/tenants/nobody/revoke", None, "tenant_not_found"),
        ("GET", "/admin/keys?tenant=nobody", None, "tenant_not_found"),
        ("POST", "/admin/keys", {"tenant": "nobody"}, "tenant_not_found"),
        ("GET", "/admin/keys/key_nothere", None, "key_not_found"),
        ("DELETE", "/admin/keys/key_nothere", None, "key_not_found"),
    ],
)
def test_unknown_tenants_and_keys_are_404(
    gateway: Gateway, method: str, path: str, body: dict | None, code: str
) -> None:
    response = admin(gateway, method, path, json=body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code


def test_refusals_are_400_or_409_and_audited(gateway: Gateway) -> None:
    assert admin(gateway, "POST", "/admin/tenants", json={"id": "dup"}).status_code == 201
    duplicate = admin(gateway, "POST", "/admin/tenants", json={"id": "dup"})
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "tenant_exists"
    taken = admin(gateway, "POST", "/admin/tenants", json={"id": "dup2", "name": "dup"})
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "name"
    for bad in ({"id": ""}, {"id": "no spaces"}, {"id": "x" * 65}, {}):
        response = admin(gateway, "POST", "/admin/tenants", json=bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert admin(gateway, "POST", "/admin/keys", json={"tenant": "dup", "name": ""}).status_code == 400
    actions = audit_actions(gateway)
    assert ("tenant.create", "dup", 409) in actions and ("tenant.create", "dup2", 409) in actions
