"""POST /admin/weights with a byte-level delta: on a gateway of its own, since it changes what serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.weight_delta import read_checkpoint, tensor_sha256, write_delta
from storage import get_version
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("delta-gateway"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def post(gateway: Gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}/admin/weights", json=body, headers=ADMIN, timeout=120)


def serving(gateway: Gateway) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/admin/weights", headers=ADMIN).json()


def make_delta(base: Path, target: Path, out: Path, base_version: str, target_version: str) -> Path:
    write_delta(
        read_checkpoint(base),
        read_checkpoint(target),
        out,
        base_version=base_version,
        target_version=target_version,
        files_from=target,
    )
    return out


def test_a_delta_rolls_out_and_the_served_weights_are_the_target(
    gateway: Gateway, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    delta = make_delta(tiny_model, perturbed_model, tmp_path / "d1", "default", "delta-v1")
    response = post(gateway, {"source": "delta", "delta_path": str(delta)})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["weight_version"] == "delta-v1" and body["previous_version"] == "default"
    full = tmp_path / "d1.full"
    assert body["model_path"] == str(full) and body["version"]["checkpoint_path"] == str(full)
    target = read_checkpoint(perturbed_model)
    assert {n: tensor_sha256(t) for n, t in read_checkpoint(full).items()} == {
        n: tensor_sha256(t) for n, t in target.items()
    }
    reply = gateway.client(gateway.keys["acme"]).chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.system_fingerprint == "delta-v1"
    with gateway.sessions()() as session:
        assert get_version(session, version_id="delta-v1").status == "serving"

    # The same delta again is out of order (its base no longer serves): 409, nothing changes.
    again = post(gateway, {"source": "delta", "delta_path": str(delta)})
    assert again.status_code == 409, again.text
    error = again.json()["error"]
    assert error["code"] == "out_of_order_delta" and error["param"] == "delta_path"
    assert "'default'" in error["message"] and "'delta-v1'" in error["message"]
    assert serving(gateway)["weight_version"] == "delta-v1"

    # The way back is a delta too, built against what serves now; the checkpoint it leads to exists
    # already (the start-up model), so it is checked and named rather than built again.
    back = make_delta(full, tiny_model, tmp_path / "d2", "delta-v1", "default")
    wrong = post(gateway, {"source": "delta", "delta_path": str(back), "model_path": str(perturbed_model)})
    assert wrong.status_code == 400 and "is not the delta's target tensor" in wrong.json()["error"]["message"]
    response = post(gateway, {"source": "delta", "delta_path": str(back), "model_path": str(tiny_model)})
    assert response.status_code == 200, response.text
    assert serving(gateway)["weight_version"] == "default" and serving(gateway)["model_path"] == str(tiny_model)
    assert not (tmp_path / "d2.full").exists()


def test_a_corrupt_delta_is_refused_and_serving_unchanged(
    gateway: Gateway, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    before = serving(gateway)
    delta = make_delta(tiny_model, perturbed_model, tmp_path / "bad", before["weight_version"], "never")
    payload = bytearray((delta / "delta.bin").read_bytes())
    payload[len(payload) // 3] ^= 0x10
    (delta / "delta.bin").write_bytes(bytes(payload))
    for body in (
        {"source": "delta", "delta_path": str(delta)},
        {"source": "delta", "delta_path": str(tmp_path / "missing")},
        {"source": "delta", "delta_path": str(delta), "weight_version": "not-its-target"},
    ):
        response = post(gateway, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_delta" and error["param"] == "delta_path"
        assert str(body["delta_path"]) in error["message"] and "keeps serving the current weights" in error["message"]
    assert not (tmp_path / "bad.full").exists()
    assert serving(gateway) == before


@pytest.mark.parametrize(
    "body",
    [
        {"source": "delta"},
        {"source": "disk", "delta_path": "/x", "weight_version": "v"},
        {"source": "tensor", "model_path": "/x", "weight_version": "v"},
    ],
)
def test_a_body_that_does_not_name_one_source_is_400(gateway: Gateway, body: dict[str, Any]) -> None:
    response = post(gateway, body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
