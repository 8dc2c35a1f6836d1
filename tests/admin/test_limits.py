"""Request limits per tenant and per key, set through the admin API, enforced with 429 + Retry-After.

The drill: one tenant with 300 concurrent chats filled the shared 256-slot engine queue and another
tenant's 8-token chats went from 0.02 s to 7.9 s; nothing could limit a tenant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.polling import wait_until

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DEFAULT_CONCURRENCY = 2


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(
        tmp_path_factory.mktemp("limits"),
        tiny_model_path(),
        admin_key=ADMIN_KEY,
        tenant_max_concurrent_requests=DEFAULT_CONCURRENCY,
    )
    with run_gateway(settings, tenants=("rpm", "tpm", "conc", "dflt", "keyed")) as gw:
        yield gw


def admin(gateway: Gateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=30, **kwargs)


def chat(gateway: Gateway, key: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(
        f"{gateway.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


class HeldStream:
    """A streamed chat that is in progress until closed: it holds one concurrency slot."""

    def __init__(self, gateway: Gateway, key: str) -> None:
        body = {
            "model": gateway.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        self._http = httpx.Client(timeout=60)
        request = self._http.build_request(
            "POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        self.response = self._http.send(request, stream=True)
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()  # kept: a dropped iterator closes the response
        next(self._lines)  # the stream has started

    def close(self) -> None:
        self.response.close()
        self._http.close()


def test_limits_are_set_read_and_cleared_through_the_admin_api(gateway: Gateway) -> None:
    path = "/admin/tenants/rpm/limits"
    assert admin(gateway, "GET", path).json() == {
        "scope": "tenant",
        "id": "rpm",
        "source": "default",
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_concurrent_requests": DEFAULT_CONCURRENCY,
    }
    stored = admin(gateway, "PUT", path, json={"requests_per_minute": 2}).json()
    assert stored["source"] == "stored" and stored["requests_per_minute"] == 2
    assert stored["max_concurrent_requests"] is None
    assert admin(gateway, "GET", path).json() == stored
    for bad in ({"requests_per_minute": 0}, {"tokens_per_minute": -5}, {"rpm": 3}):
        assert admin(gateway, "PUT", path, json=bad).status_code == 400, bad
    assert admin(gateway, "PUT", "/admin/tenants/nobody/limits", json={}).status_code == 404
    assert admin(gateway, "GET", "/admin/keys/key_nobody/limits").status_code == 404
    tenant_key = gateway.keys["rpm"]
    refused = httpx.put(f"{gateway.url}{path}", json={}, headers={"Authorization": f"Bearer {tenant_key}"})
    assert refused.status_code == 403


def test_requests_per_minute_answer_429_with_retry_after(gateway: Gateway) -> None:
    assert admin(gateway, "PUT", "/admin/tenants/rpm/limits", json={"requests_per_minute": 2}).status_code == 200
    key = gateway.keys["rpm"]
    assert [chat(gateway, key).status_code for _ in range(2)] == [200, 200]
    refused = chat(gateway, key)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "requests_per_minute_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert chat(gateway, gateway.keys["dflt"]).status_code == 200  # other tenants are not affected
    assert admin(gateway, "DELETE", "/admin/tenants/rpm/limits").json()["source"] == "default"
    assert chat(gateway, key).status_code == 200


def test_tokens_per_minute_count_the_prompt_and_the_completion_budget(gateway: Gateway) -> None:
    assert admin(gateway, "PUT", "/admin/tenants/tpm/limits", json={"tokens_per_minute": 100}).status_code == 200
    key = gateway.keys["tpm"]
    too_big = chat(gateway, key, max_tokens=200)  # more than a whole minute's budget: no point retrying
    assert too_big.status_code == 429 and "retry-after" not in too_big.headers
    assert too_big.json()["error"]["code"] == "tokens_per_minute_exceeded"
    statuses = [chat(gateway, key, max_tokens=30).status_code for _ in range(4)]
    assert statuses[0] == 200 and statuses[-1] == 429  # the prompt (~10 tokens) plus 30, per request


def test_concurrent_requests_are_held_until_the_stream_ends(gateway: Gateway) -> None:
    assert admin(gateway, "PUT", "/admin/tenants/conc/limits", json={"max_concurrent_requests": 1}).status_code == 200
    key = gateway.keys["conc"]
    stream = HeldStream(gateway, key)
    try:
        refused = chat(gateway, key)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "concurrent_requests_exceeded"
    finally:
        stream.close()
    wait_until(lambda: chat(gateway, key).status_code == 200, timeout_s=30, what="the slot is released")


def test_the_default_tenant_limit_applies_without_stored_limits(gateway: Gateway) -> None:
    key = gateway.keys["dflt"]
    streams = [HeldStream(gateway, key) for _ in range(DEFAULT_CONCURRENCY)]
    try:
        assert chat(gateway, key).status_code == 429
        assert chat(gateway, ADMIN_KEY).status_code == 200  # the admin key is not limited
    finally:
        for stream in streams:
            stream.close()


def test_a_keys_own_limit_applies_beside_its_tenants(gateway: Gateway) -> None:
    created = admin(gateway, "POST", "/admin/keys", json={"tenant": "keyed", "name": "limited"}).json()
    limits = admin(gateway, "PUT", f"/admin/keys/{created['id']}/limits", json={"requests_per_minute": 1})
    assert limits.json()["scope"] == "key"
    assert chat(gateway, created["key"]).status_code == 200
    assert chat(gateway, created["key"]).status_code == 429
    assert chat(gateway, gateway.keys["keyed"]).status_code == 200  # the tenant's other key is not limited
