"""GET/POST /admin/weights on the shared gateway: admin key only, a bad checkpoint leaves serving as it was.

A successful rollout changes the shared gateway's weights, so it is tested on a gateway of its own
in tests/e2e/test_learning_round.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, Gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def serving(gateway: Gateway) -> dict:
    response = httpx.get(f"{gateway.url}/admin/weights", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def test_get_reports_the_engine_weights(gateway: Gateway, tiny_model: Path) -> None:
    body = serving(gateway)
    assert body["model"] == gateway.model
    assert body["weight_version"] == "default"
    assert Path(body["model_path"]) == tiny_model
    assert body["version"] is None  # nothing recorded yet for the start-up weights


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_needs_the_admin_key(gateway: Gateway, method: str) -> None:
    body = {"model_path": "/nowhere", "weight_version": "x"}
    missing = httpx.request(method, f"{gateway.url}/admin/weights", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    tenant = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    forbidden = httpx.request(method, f"{gateway.url}/admin/weights", json=body, headers=tenant)
    assert forbidden.status_code == 403
    assert forbidden.json()["error"] == {
        "message": "This endpoint needs the admin key (TANDEM_ADMIN_KEY), not a tenant's API key.",
        "type": "permission_error",
        "param": None,
        "code": "admin_required",
    }


def test_bad_checkpoint_is_refused_and_serving_unchanged(gateway: Gateway, tmp_path: Path) -> None:
    before = serving(gateway)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    for path in (tmp_path / "missing", tmp_path, broken):
        response = httpx.post(
            f"{gateway.url}/admin/weights",
            json={"model_path": str(path), "weight_version": "bad-one"},
            headers=ADMIN,
            timeout=60,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_checkpoint"
        assert error["param"] == "model_path"
        assert str(path) in error["message"] and "keeps serving" in error["message"]
    assert serving(gateway) == before
    reply = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.system_fingerprint == before["weight_version"]


def test_invalid_body_is_400(gateway: Gateway) -> None:
    response = httpx.post(f"{gateway.url}/admin/weights", json={"model_path": ""}, headers=ADMIN)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
