"""Real answers of the live gateway (admin API included) against the response model each route
declares: every body validates, holds no key the model leaves out (at any depth), and the model is
the one /openapi.json names for that operation."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter

from admin import schemas
from admin.routes.limits import LimitsView
from server.response_models import (
    ChatCompletion,
    CompletionLog,
    Feedback,
    Health,
    ModelList,
    Rollouts,
    ServingWeights,
)
from storage.model_versions import record_model_version
from storage.rounds import finish_round, start_round
from storage.times import utcnow
from tests.server.conftest import ADMIN_KEY, Gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "schema-check"  # rows of this test's own, apart from what other tests list
USER = "schema/user"  # a "/" too: the export path takes it percent-encoded


@pytest.fixture(scope="module")
def openapi(gateway: Gateway) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()


def same_keys(body: Any, dumped: Any, where: str = "body") -> None:
    """``body`` and the model's dump of it have the same keys at every depth."""
    if isinstance(body, dict):
        assert set(body) == set(dumped), (
            f"{where}: undeclared {set(body) - set(dumped)}, absent {set(dumped) - set(body)}"
        )
        for key, value in body.items():
            same_keys(value, dumped[key], f"{where}.{key}")
    elif isinstance(body, list):
        for i, (item, dumped_item) in enumerate(zip(body, dumped, strict=True)):
            same_keys(item, dumped_item, f"{where}[{i}]")


def declared(openapi: dict[str, Any], method: str, template: str, status: int) -> str:
    schema = openapi["paths"][template][method.lower()]["responses"][str(status)]["content"]["application/json"]
    return schema["schema"]["$ref"].rsplit("/", 1)[1]


class Api:
    """Calls the gateway and checks each JSON answer against the route's declared model."""

    def __init__(self, gateway: Gateway, openapi: dict[str, Any]) -> None:
        self.gateway = gateway
        self.openapi = openapi

    def __call__(
        self,
        model: type[BaseModel],
        method: str,
        template: str,
        path: str | None = None,
        status: int = 200,
        key: str = ADMIN_KEY,
        **kwargs: Any,
    ) -> Any:
        """The body of ``method`` on ``path`` (``template`` filled in; the template by default)."""
        response = httpx.request(
            method,
            f"{self.gateway.url}{path or template}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            **kwargs,
        )
        assert response.status_code == status, response.text
        assert declared(self.openapi, method, template, status) == model.__name__
        body = response.json()
        adapter = TypeAdapter(model)
        same_keys(body, adapter.dump_python(adapter.validate_python(body), mode="json", by_alias=True))
        return body


@pytest.fixture(scope="module")
def api(gateway: Gateway, openapi: dict[str, Any]) -> Api:
    return Api(gateway, openapi)


def test_health_models_engines_and_weights(api: Api, gateway: Gateway) -> None:
    api(Health, "GET", "/health")
    assert api(ModelList, "GET", "/v1/models", key=gateway.keys["acme"])["data"][0]["id"] == gateway.model
    [replica] = api(schemas.EngineReplicaList, "GET", "/admin/engines")["data"]
    api(schemas.EngineReplica, "GET", "/admin/engines/{replica}", f"/admin/engines/{replica['id']}")
    api(ServingWeights, "GET", "/admin/weights")


def test_completion_feedback_log_ratings_and_user_data(api: Api, gateway: Gateway) -> None:
    tenant_key = gateway.keys["acme"]
    chat = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "user": USER,
    }
    completion = api(ChatCompletion, "POST", "/v1/chat/completions", key=tenant_key, json=chat)
    rating = {"completion_id": completion["id"], "rating": "up", "choice_index": 1, "comment": "fine"}
    api(Feedback, "POST", "/v1/feedback", status=201, key=tenant_key, json=rating)
    log_path = f"/v1/completions/{completion['id']}"
    logged = api(CompletionLog, "GET", "/v1/completions/{completion_id}", log_path, key=tenant_key)
    assert logged["choices"][1]["feedback"]["history"]  # the nested storage views are checked too
    assert api(schemas.RatedVersionList, "GET", "/admin/stats/ratings")["data"]
    data_path = "/admin/users/schema%2Fuser/data?tenant=acme"
    assert api(schemas.UserDataExport, "GET", "/admin/users/{user}/data", data_path)["completions"]
    api(schemas.UserDataDeletion, "DELETE", "/admin/users/{user}/data", data_path)
    rollout = {"messages": [{"role": "user", "content": "Say hi."}], "n": 2, "max_tokens": 2}
    api(Rollouts, "POST", "/admin/rollouts", json=rollout)


def test_a_completion_with_tool_calls(api: Api, gateway: Gateway) -> None:
    parameters = {"type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}
    tool = {
        "type": "function",
        "function": {"name": "search", "parameters": parameters | {"additionalProperties": False}},
    }
    chat = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": "Search."}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 200,
    }
    completion = api(ChatCompletion, "POST", "/v1/chat/completions", key=gateway.keys["acme"], json=chat)
    assert completion["choices"][0]["finish_reason"] == "tool_calls"
    assert completion["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"


def test_tenants_keys_limits_and_audit(api: Api) -> None:
    api(schemas.Tenant, "POST", "/admin/tenants", status=201, json={"id": "schema-co", "name": "Schema Co"})
    assert "schema-co" in {t["id"] for t in api(schemas.TenantList, "GET", "/admin/tenants")["data"]}
    api(schemas.Tenant, "GET", "/admin/tenants/{tenant_id}", "/admin/tenants/schema-co")
    key = api(schemas.CreatedKey, "POST", "/admin/keys", status=201, json={"tenant": "schema-co"})
    assert [k["id"] for k in api(schemas.ApiKeyList, "GET", "/admin/keys", "/admin/keys?tenant=schema-co")["data"]] == [
        key["id"]
    ]
    api(schemas.ApiKey, "GET", "/admin/keys/{key_id}", f"/admin/keys/{key['id']}")
    api(LimitsView, "GET", "/admin/tenants/{subject_id}/limits", "/admin/tenants/schema-co/limits")
    assert api(schemas.ServerToolList, "GET", "/admin/tools") == {"object": "list", "data": [], "max_steps": 0}
    tools = "/admin/tenants/schema-co/tools"
    api(schemas.TenantTools, "PUT", "/admin/tenants/{tenant_id}/tools", tools, json={"tools": []})
    assert api(schemas.TenantTools, "GET", "/admin/tenants/{tenant_id}/tools", tools)["tools"] == []
    api(schemas.ApiKey, "DELETE", "/admin/keys/{key_id}", f"/admin/keys/{key['id']}")
    api(schemas.RevokedTenant, "POST", "/admin/tenants/{tenant_id}/revoke", "/admin/tenants/schema-co/revoke")
    assert api(schemas.AuditPage, "GET", "/admin/audit", "/admin/audit?limit=2")["has_more"]


def test_runs_and_versions(api: Api, gateway: Gateway) -> None:
    began = utcnow() - timedelta(minutes=5)
    with gateway.sessions().begin() as session:
        record_model_version(session, version_id="schema-v1", model=MODEL, checkpoint_path="/ckpt/v1", now=began)
        run = start_round(session, model=MODEL, worker_id="w", base_version_id="schema-v1", now=began)
        record_model_version(
            session,
            version_id="schema-v2",
            model=MODEL,
            checkpoint_path="/ckpt/v2",
            parent_id="schema-v1",
            metrics={"loss": 0.5},
            now=began + timedelta(minutes=1),
        )
        finish_round(
            session,
            round_id=run.id,
            status="succeeded",
            watermark_to=3,
            metrics={"seconds": {"train": 12.5}},
            produced_version_id="schema-v2",
            now=began + timedelta(minutes=1),
        )
    [summary] = api(schemas.RunPage, "GET", "/admin/runs", f"/admin/runs?model={MODEL}")["data"]
    detail = api(schemas.RunDetail, "GET", "/admin/runs/{round_id}", f"/admin/runs/{summary['id']}")
    assert detail["timings"]["stages_s"] == {"train": 12.5}
    versions = api(schemas.ModelVersionPage, "GET", "/admin/models", f"/admin/models?model={MODEL}&limit=1")
    assert versions["has_more"] and versions["data"][0]["lineage"] == ["schema-v2", "schema-v1"]
    detail = api(schemas.ModelVersionDetail, "GET", "/admin/models/{version_id}", "/admin/models/schema-v2")
    assert [ancestor["id"] for ancestor in detail["ancestors"]] == ["schema-v1"]


def test_schedules(api: Api) -> None:
    body = {"name": "schema-nightly", "kind": "cron", "cron": "0 3 * * *"}
    created = api(schemas.Schedule, "POST", "/admin/schedules", status=201, json=body)
    one = f"/admin/schedules/{created['id']}"
    assert created["id"] in {s["id"] for s in api(schemas.SchedulePage, "GET", "/admin/schedules")["data"]}
    api(schemas.Schedule, "PATCH", "/admin/schedules/{schedule_id}", one, json={"cron": "0 4 * * *"})
    api(schemas.Schedule, "POST", "/admin/schedules/{schedule_id}/disable", f"{one}/disable")
    api(schemas.Schedule, "GET", "/admin/schedules/{schedule_id}", one)
    assert api(schemas.DeletedSchedule, "DELETE", "/admin/schedules/{schedule_id}", one)["deleted"] is True
