"""/admin/users/{user}/data on a live gateway (tiny model), on SQLite and PostgreSQL: real chat traffic
and ratings, exported, then deleted: the learner's reads no longer see it, the tombstone and the
audit entry are written, and the user can come back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import torch
from openai import OpenAI

from storage import collect_feedback, count_feedback_since, rating_history
from storage.audit import list_admin_actions
from storage.data_deletions import list_deletions
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANT = f"acme-{uuid.uuid4().hex[:8]}"  # the PostgreSQL database is shared by the test session


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    data_dir = tmp_path_factory.mktemp("users")
    database = {"database_url": request.getfixturevalue("postgres_url")} if request.param == "postgres" else {}
    settings = gateway_settings(data_dir, tiny_model_path(), admin_key=ADMIN_KEY, **database)
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def data_url(gateway: Gateway, user: str) -> str:
    return f"{gateway.url}/admin/users/{quote(user, safe='')}/data"


def admin(gateway: Gateway, method: str, user: str, **params: str) -> httpx.Response:
    return httpx.request(method, data_url(gateway, user), headers=ADMIN, params=params or {"tenant": TENANT})


def tenant_key(gateway: Gateway) -> dict[str, str]:
    return {"Authorization": f"Bearer {gateway.keys[TENANT]}"}


def chat(client: OpenAI, gateway: Gateway, user: str, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=gateway.model, messages=messages, max_tokens=3, user=user).id  # type: ignore[arg-type]


def rate(client: OpenAI, completion_id: str, rating: str) -> None:
    client.post("/feedback", body={"completion_id": completion_id, "rating": rating}, cast_to=object)


def learner_view(gateway: Gateway) -> tuple[set[str | None], set[str | None], int]:
    """Users whose ratings a round would collect, the baselines' users, and the due count."""
    with gateway.sessions()() as session:
        collected = {item.user_id for item in collect_feedback(session, model=gateway.model, since=0).items}
        baselines = {record.user_id for record in rating_history(session, model=gateway.model)}
        return collected, baselines, count_feedback_since(session, model=gateway.model, since=0)


def test_export_then_delete(gateway: Gateway) -> None:
    client = gateway.client(gateway.keys[TENANT])
    first, second = chat(client, gateway, "alice", "Hello?"), chat(client, gateway, "alice", "And again?")
    rate(client, first, "up")
    rate(client, first, "down")
    rate(client, chat(client, gateway, "bob", "Hi."), "up")
    odd = chat(client, gateway, "team/ünï?#%", "Hi.")

    exported = admin(gateway, "GET", "alice")
    assert exported.status_code == 200, exported.text
    data = exported.json()
    assert (data["object"], data["tenant_id"], data["user"], data["deletions"]) == ("user_data", TENANT, "alice", [])
    assert [(s["session_key"], s["turn_count"]) for s in data["sessions"]] == [("alice", 2)]
    assert [c["id"] for c in data["completions"]] == [first, second]
    turn = data["completions"][0]
    assert (turn["end_user"], turn["turn_index"], turn["request_messages"][-1]["content"]) == ("alice", 0, "Hello?")
    choice = turn["choices"][0]
    assert choice["text"] and len(choice["token_ids"]) == turn["completion_tokens"]
    assert [e["rating"] for e in choice["feedback"]["history"]] == ["up", "down"]
    assert [c["id"] for c in admin(gateway, "GET", "team/ünï?#%").json()["completions"]] == [odd]
    collected, baselines, due = learner_view(gateway)
    assert "alice" in collected and "alice" in baselines

    deleted = admin(gateway, "DELETE", "alice")
    assert deleted.status_code == 200, deleted.text
    body = deleted.json()
    assert (body["object"], body["tenant_id"], body["user"]) == ("user_data.deletion", TENANT, "alice")
    assert body["counts"] | {"feedback_changes": None} == {
        "feedback_changes": None,
        "feedback_events": 2,
        "feedback": 1,
        "completion_choices": 2,
        "completions": 2,
        "sessions": 1,
        "end_users": 1,
        "canaries": 0,  # deleting a user's canaries: tests/admin/test_canaries.py
        "adapters": 0,  # deleting a user's adapters: tests/admin/test_adapters.py
        "cohort_members": 0,
    }
    collected, baselines, due_after = learner_view(gateway)
    assert "alice" not in collected and "alice" not in baselines and "bob" in collected
    assert due_after == due - 1
    lookup = httpx.get(f"{gateway.url}/v1/completions/{first}", headers=tenant_key(gateway))
    assert lookup.status_code == 404

    assert admin(gateway, "GET", "alice").json()["error"]["code"] == "user_not_found"
    assert admin(gateway, "DELETE", "alice").status_code == 404  # deleted already
    with gateway.sessions()() as session:
        tombstones = list_deletions(session, tenant_id=TENANT, end_user="alice")
        actions = [(a.action, a.target, a.status_code, a.details) for a in list_admin_actions(session, limit=1000)]
    assert [(t.counts, t.deleted_at.isoformat()) for t in tombstones] == [(body["counts"], body["deleted_at"])]
    assert tombstones[0].actor.startswith("admin:")
    assert ("user_data.delete", "alice", 200, {"tenant_id": TENANT, "counts": body["counts"]}) in actions
    assert ("user_data.delete", "alice", 404) in [a[:3] for a in actions]

    back = chat(client, gateway, "alice", "I am back.")  # after her deletion: her new data is kept
    again = admin(gateway, "GET", "alice").json()
    assert [c["id"] for c in again["completions"]] == [back]
    assert [d["counts"] for d in again["deletions"]] == [body["counts"]]


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_refusals(gateway: Gateway, method: str) -> None:
    url = data_url(gateway, "alice")
    missing = httpx.request(method, url)
    assert (missing.status_code, missing.json()["error"]["type"]) == (401, "authentication_error")
    forbidden = httpx.request(method, url, headers=tenant_key(gateway))
    assert (forbidden.status_code, forbidden.json()["error"]["code"]) == (403, "admin_required")

    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("nobody", {"tenant": TENANT}, 404, "user_not_found"),
        ("alice", {"tenant": "no-such-tenant"}, 404, "tenant_not_found"),
        ("x" * 257, {"tenant": TENANT}, 400, "invalid_request"),
        ("alice", {"tenant": "t" * 65}, 400, "invalid_request"),
    ]
    for user, params, status, code in cases:
        response = admin(gateway, method, user, **params)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    # Without ``tenant``: the default tenant, where this gateway's users are not.
    default = httpx.request(method, data_url(gateway, "bob"), headers=ADMIN)
    assert default.status_code == 404 and "'default'" in default.json()["error"]["message"]
