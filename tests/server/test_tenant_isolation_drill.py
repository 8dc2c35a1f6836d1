"""Tenant isolation as a drill over every route of /openapi.json: tenant B, holding tenant A's real
ids, can neither read, rate, continue, export nor delete anything of A's, and cannot even tell A's
ids from ids that do not exist. (The prefix-cache leak has its own test: test_tenant_isolation.py.)"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.server.conftest import Gateway

# Every route a tenant key may call, and where this drill checks it. A new route fails
# test_the_drill_knows_every_route until it is added here (and checked below).
TENANT_ROUTES = {
    ("post", "/v1/chat/completions"): "sessions stay the tenant's own",
    ("get", "/v1/models"): "the same list for every tenant, nothing tenant-owned",
    ("post", "/v1/feedback"): "another tenant's completion is not found",
    ("get", "/v1/completions/{completion_id}"): "another tenant's completion is not found",
    ("get", "/health"): "no tenant data",
    ("get", "/metrics"): "admin key only",
}
METHODS = ("get", "post", "put", "patch", "delete")
SESSION = {"X-Session-Id": "isolation-drill-session"}


@pytest.fixture(scope="module")
def spec(gateway: Gateway) -> dict[str, Any]:
    spec: dict[str, Any] = httpx.get(f"{gateway.url}/openapi.json").json()
    return spec


def ask_in_the_shared_session(gateway: Gateway, tenant: str) -> str:
    """The same question, end user and session id, as ``tenant``: the answer's id."""
    return (
        gateway.client(gateway.keys[tenant])
        .chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": "acme's secret plan"}],
            max_tokens=3,
            user="shared-end-user",
            extra_headers=SESSION,
        )
        .id
    )


@pytest.fixture(scope="module")
def a_answer(gateway: Gateway) -> str:
    """Tenant A's rated answer in a session; its id is what B tries everywhere."""
    answer = ask_in_the_shared_session(gateway, "acme")
    gateway.client(gateway.keys["acme"]).post(
        "/feedback", cast_to=object, body={"completion_id": answer, "rating": "up"}
    )
    return answer


def test_the_drill_knows_every_route(spec: dict[str, Any]) -> None:
    public = {(method, path) for path, ops in spec["paths"].items() if not path.startswith("/admin") for method in ops}
    assert public == set(TENANT_ROUTES)


def test_another_tenants_completion_is_indistinguishable_from_a_missing_one(gateway: Gateway, a_answer: str) -> None:
    missing = "chatcmpl-" + "0" * 32
    answers = {}
    with httpx.Client(base_url=f"{gateway.url}/v1", headers={"Authorization": f"Bearer {gateway.keys['globex']}"}) as b:
        for completion_id in (a_answer, missing):
            read = b.get(f"/completions/{completion_id}")
            rated = b.post("/feedback", json={"completion_id": completion_id, "rating": "down"})
            answers[completion_id] = [
                (r.status_code, r.json()["error"]["message"].replace(completion_id, "<id>")) for r in (read, rated)
            ]
    assert answers[a_answer] == answers[missing]
    assert [status for status, _ in answers[a_answer]] == [404, 404]
    # A's rating is untouched: still A's one "up", never revised by B.
    logged = gateway.client(gateway.keys["acme"]).get(f"/completions/{a_answer}", cast_to=object)
    feedback = logged["choices"][0]["feedback"]  # type: ignore[index]
    assert (feedback["rating"], feedback["revision"], len(feedback["history"])) == ("up", 1, 1)


def test_the_same_session_id_in_another_tenant_starts_its_own_session(gateway: Gateway, a_answer: str) -> None:
    answer = ask_in_the_shared_session(gateway, "globex")
    theirs = gateway.client(gateway.keys["globex"]).get(f"/completions/{answer}", cast_to=object)
    ours = gateway.client(gateway.keys["acme"]).get(f"/completions/{a_answer}", cast_to=object)
    assert theirs["turn_index"] == 0 and theirs["previous_completion_id"] is None  # type: ignore[index]
    assert ours["turn_index"] == 0  # type: ignore[index]


def test_every_admin_route_refuses_a_tenant_key_even_with_real_ids(
    gateway: Gateway, spec: dict[str, Any], a_answer: str
) -> None:
    """Export, deletion, adapters, versions, users: all admin routes; B's key gets 403 on each, with
    A's completion id and A's tenant name in every path parameter."""
    refused, checked = [], 0
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {gateway.keys['globex']}"}) as b:
        for path, ops in spec["paths"].items():
            if not path.startswith("/admin") and path != "/metrics":
                continue
            for method in set(ops) & set(METHODS):
                for value in (a_answer, "acme"):
                    url = re.sub(r"\{[^}/]+(:path)?\}", value, path)
                    response = b.request(method.upper(), url, json={} if method != "get" else None)
                    checked += 1
                    if response.status_code != 403:
                        refused.append(f"{method.upper()} {url}: {response.status_code}")
    assert checked > 100 and refused == []
