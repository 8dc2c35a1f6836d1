"""/admin/adapters and /admin/tenants/{id}/cohorts on a live gateway (tiny model, SQLite, the local
engine serving real peft LoRA folders), driven with the official openai client.

Each request is served by its user's adapter, else their cohort's, else their tenant's, else the base
alone, and says which in X-Tandem-Adapter. The gateway rereads the serving adapters only after its
own changes here (the periodic reread is set to an hour), so every check that the next request sees
a change proves the admin route served it at once.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import torch
from openai import NOT_GIVEN, OpenAI
from pydantic import BaseModel, TypeAdapter

from admin import schemas
from storage.adapters import set_adapter_status
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.server.engines.test_local_lora import make_adapter
from tests.server.test_response_models import declared, same_keys
from tests.support.polling import wait_until
from tests.support.streaming_load import StreamingLoad

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADAPTER_HEADER = "x-tandem-adapter"
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(
        tmp_path_factory.mktemp("adapters-gw"), tiny_model_path(), admin_key=ADMIN_KEY, adapter_refresh_s=3600
    )
    with run_gateway(settings, tenants=("acme", "globex")) as gw:
        yield gw


@pytest.fixture(scope="module")
def openapi(gateway: Gateway) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()


class Folders:
    """Fresh peft LoRA folders of the tiny model, each with its own random factors."""

    def __init__(self, root: Path) -> None:
        self.root, self.made = root, 0

    def __call__(self) -> Path:
        self.made += 1
        return make_adapter(tiny_model_path(), self.root / f"lora-{self.made}", seed=self.made, targets=TARGETS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    return Folders(tmp_path_factory.mktemp("loras"))


def admin(gateway: Gateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=60, **kwargs)


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["message"] and body["type"]
    if code is not None:
        assert body["code"] == code, body
    return body


def typed(model: type[BaseModel], body: Any) -> Any:
    """``body`` validates against ``model`` and has exactly its keys, at every depth."""
    adapter = TypeAdapter(model)
    same_keys(body, adapter.dump_python(adapter.validate_python(body), mode="json", by_alias=True))
    return body


def register(gateway: Gateway, folder: Path, tenant: str, scope_kind: str, scope: str) -> str:
    body = {"tenant_id": tenant, "scope_kind": scope_kind, "scope": scope, "checkpoint_path": str(folder)}
    created = typed(schemas.Adapter, ok(admin(gateway, "POST", "/admin/adapters", json=body), 201))
    assert created["status"] == "candidate" and created["object"] == "adapter"
    return str(created["id"])


def promote(gateway: Gateway, adapter_id: str, **body: Any) -> dict[str, Any]:
    answer = typed(schemas.AdapterSwap, ok(admin(gateway, "POST", f"/admin/adapters/{adapter_id}/promote", json=body)))
    assert answer["adapter"]["id"] == adapter_id and answer["adapter"]["status"] == "serving"
    return answer


def rollback(gateway: Gateway, adapter_id: str) -> dict[str, Any]:
    answer = typed(schemas.AdapterSwap, ok(admin(gateway, "POST", f"/admin/adapters/{adapter_id}/rollback")))
    assert answer["adapter"]["id"] == adapter_id and answer["adapter"]["status"] == "serving"
    return answer


def reset(gateway: Gateway, tenant: str, scope_kind: str, scope: str) -> str | None:
    body = {"tenant_id": tenant, "scope_kind": scope_kind, "scope": scope}
    answer = typed(schemas.AdapterReset, ok(admin(gateway, "POST", "/admin/adapters/reset", json=body)))
    return answer["retired_adapter_id"]  # type: ignore[no-any-return]


def status_of(gateway: Gateway, adapter_id: str) -> str:
    return str(typed(schemas.Adapter, ok(admin(gateway, "GET", f"/admin/adapters/{adapter_id}")))["status"])


def client(gateway: Gateway, tenant: str) -> OpenAI:
    return gateway.client(gateway.keys[tenant])


def served(gateway: Gateway, tenant: str, user: str | None) -> str | None:
    """The adapter that answered one chat of ``user`` (None: the base alone)."""
    raw = client(gateway, tenant).chat.completions.with_raw_response.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=2,
        user=user if user is not None else NOT_GIVEN,
    )
    assert raw.parse().choices[0].message.content is not None
    return raw.headers.get(ADAPTER_HEADER)


def audit(gateway: Gateway, action: str) -> list[dict[str, Any]]:
    return ok(admin(gateway, "GET", "/admin/audit", params={"action": action}))["data"]  # type: ignore[no-any-return]


ENDPOINTS = [
    ("GET", "/admin/adapters"),
    ("GET", "/admin/adapters/ad-000000000000"),
    ("POST", "/admin/adapters"),
    ("POST", "/admin/adapters/ad-000000000000/promote"),
    ("POST", "/admin/adapters/ad-000000000000/rollback"),
    ("POST", "/admin/adapters/reset"),
    ("GET", "/admin/tenants/acme/cohorts"),
    ("PUT", "/admin/tenants/acme/cohorts/beta"),
    ("DELETE", "/admin/tenants/acme/cohorts/beta"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_admin_key_required(gateway: Gateway, method: str, path: str) -> None:
    url = f"{gateway.url}{path}"
    body = {"users": ["x"]} if method == "PUT" else None
    error(httpx.request(method, url, json=body), 401, "missing_api_key")
    error(httpx.request(method, url, headers={"Authorization": "Bearer wrong"}, json=body), 401, "invalid_api_key")
    tenant = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    error(httpx.request(method, url, headers=tenant, json=body), 403, "admin_required")


def test_every_route_declares_its_answer(openapi: dict[str, Any]) -> None:
    for method, template, status, model in (
        ("GET", "/admin/adapters", 200, schemas.AdapterList),
        ("POST", "/admin/adapters", 201, schemas.Adapter),
        ("GET", "/admin/adapters/{adapter_id}", 200, schemas.Adapter),
        ("POST", "/admin/adapters/{adapter_id}/promote", 200, schemas.AdapterSwap),
        ("POST", "/admin/adapters/{adapter_id}/rollback", 200, schemas.AdapterSwap),
        ("POST", "/admin/adapters/reset", 200, schemas.AdapterReset),
        ("GET", "/admin/tenants/{tenant_id}/cohorts", 200, schemas.CohortList),
        ("PUT", "/admin/tenants/{tenant_id}/cohorts/{name}", 200, schemas.Cohort),
        ("DELETE", "/admin/tenants/{tenant_id}/cohorts/{name}", 200, schemas.Cohort),
    ):
        assert declared(openapi, method, template, status) == model.__name__, (method, template)
        refusals = (400, 401, 404, 409) if template.endswith(("promote", "rollback")) else (400, 401, 404)
        for refusal in refusals:
            assert str(refusal) in openapi["paths"][template][method.lower()]["responses"], (method, template)


def test_a_promoted_user_adapter_serves_that_user_only(gateway: Gateway, folders: Folders) -> None:
    folder = folders()
    assert served(gateway, "acme", "ann") is None
    ann = register(gateway, folder, "acme", "user", "ann")
    assert re.fullmatch(r"ad-[0-9a-f]{12}", ann), ann
    shown = ok(admin(gateway, "GET", f"/admin/adapters/{ann}"))
    assert shown["model"] == gateway.model and shown["checkpoint_path"] == str(folder)
    assert (shown["tenant_id"], shown["scope_kind"], shown["scope"]) == ("acme", "user", "ann")
    assert served(gateway, "acme", "ann") is None  # a candidate serves nobody

    swap = promote(gateway, ann, reason="trained offline")
    assert swap["previous_adapter_id"] is None and swap["adapter"]["promoted_at"] is not None

    raw = client(gateway, "acme").chat.completions.with_raw_response.create(
        model=gateway.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, user="ann"
    )
    assert raw.headers[ADAPTER_HEADER] == ann
    logged: Any = client(gateway, "acme").get(f"/completions/{raw.parse().id}", cast_to=object)
    assert logged["adapter_id"] == ann
    assert served(gateway, "acme", "bob") is None  # another user of the tenant
    assert served(gateway, "acme", None) is None  # nobody named
    assert served(gateway, "globex", "ann") is None  # another tenant's ann

    listed = typed(schemas.AdapterList, ok(admin(gateway, "GET", "/admin/adapters", params={"scope": "ann"})))
    assert [a["id"] for a in listed["data"]] == [ann]
    for params in ({"tenant": "acme", "scope_kind": "user", "status": "serving"}, {"limit": 500}):
        assert ann in {a["id"] for a in ok(admin(gateway, "GET", "/admin/adapters", params=params))["data"]}
    assert ok(admin(gateway, "GET", "/admin/adapters", params={"tenant": "globex"}))["data"] == []
    assert ok(admin(gateway, "GET", "/admin/adapters", params={"scope": "ann", "status": "retired"}))["data"] == []


def test_cohort_and_tenant_adapters_serve_whoever_has_nothing_more_specific(gateway: Gateway, folders: Folders) -> None:
    beta = typed(
        schemas.Cohort,
        ok(admin(gateway, "PUT", "/admin/tenants/acme/cohorts/beta", json={"users": ["dee", "cal", "cal"]})),
    )
    assert beta == {"name": "beta", "users": ["cal", "dee"]}
    cohort = register(gateway, folders(), "acme", "cohort", "beta")
    promote(gateway, cohort)
    assert served(gateway, "acme", "cal") == cohort
    assert served(gateway, "acme", "eve") is None  # in no cohort

    ann = register(gateway, folders(), "acme", "user", "ann-2")
    promote(gateway, ann)
    ok(admin(gateway, "PUT", "/admin/tenants/acme/cohorts/beta", json={"users": ["ann-2", "cal", "dee"]}))
    assert served(gateway, "acme", "ann-2") == ann  # her own adapter before her cohort's

    tenant = register(gateway, folders(), "acme", "tenant", "acme")
    promote(gateway, tenant)
    assert served(gateway, "acme", "eve") == tenant
    assert served(gateway, "acme", None) == tenant
    assert served(gateway, "acme", "cal") == cohort
    assert served(gateway, "globex", "eve") is None  # nobody of another tenant
    assert served(gateway, "globex", "cal") is None

    # A user of another cohort moves: dee leaves beta for gamma, which has no adapter.
    gamma = ok(admin(gateway, "PUT", "/admin/tenants/acme/cohorts/gamma", json={"users": ["dee"]}))
    assert gamma == {"name": "gamma", "users": ["dee"]}
    listed = typed(schemas.CohortList, ok(admin(gateway, "GET", "/admin/tenants/acme/cohorts")))
    assert listed == {
        "object": "list",
        "data": [{"name": "beta", "users": ["ann-2", "cal"]}, {"name": "gamma", "users": ["dee"]}],
    }
    assert ok(admin(gateway, "GET", "/admin/tenants/globex/cohorts"))["data"] == []
    assert served(gateway, "acme", "dee") == tenant

    emptied = typed(schemas.Cohort, ok(admin(gateway, "DELETE", "/admin/tenants/acme/cohorts/beta")))
    assert emptied == {"name": "beta", "users": []}
    assert served(gateway, "acme", "cal") == tenant
    error(admin(gateway, "DELETE", "/admin/tenants/acme/cohorts/beta"), 404, "cohort_not_found")
    assert status_of(gateway, cohort) == "serving"  # the cohort's adapter stays, serving nobody

    assert reset(gateway, "acme", "tenant", "acme") == tenant
    assert served(gateway, "acme", "eve") is None and served(gateway, "acme", "dee") is None
    assert reset(gateway, "acme", "tenant", "acme") is None  # nothing serves it any more
    assert status_of(gateway, tenant) == "retired"
    ok(admin(gateway, "DELETE", "/admin/tenants/acme/cohorts/gamma"))


def test_promote_rollback_and_reset_change_the_next_request(gateway: Gateway, folders: Folders) -> None:
    v1 = register(gateway, folders(), "globex", "user", "fay")
    v2 = register(gateway, folders(), "globex", "user", "fay")
    assert promote(gateway, v1)["previous_adapter_id"] is None
    assert served(gateway, "globex", "fay") == v1
    assert promote(gateway, v2)["previous_adapter_id"] == v1
    assert status_of(gateway, v1) == "retired"
    assert served(gateway, "globex", "fay") == v2

    back = rollback(gateway, v1)
    assert back["previous_adapter_id"] == v2 and back["adapter"]["retired_at"] is None
    assert status_of(gateway, v2) == "retired"
    assert served(gateway, "globex", "fay") == v1

    assert reset(gateway, "globex", "user", "fay") == v1
    assert served(gateway, "globex", "fay") is None  # back to the base: globex has no other adapter
    assert status_of(gateway, v1) == "retired"
    assert rollback(gateway, v2)["previous_adapter_id"] is None
    assert served(gateway, "globex", "fay") == v2
    assert [a["id"] for a in ok(admin(gateway, "GET", "/admin/adapters", params={"scope": "fay"}))["data"]] == [v2, v1]


def test_a_promotion_under_streaming_load_fails_nothing(gateway: Gateway, folders: Folders) -> None:
    old = register(gateway, folders(), "acme", "user", "gus")
    new = register(gateway, folders(), "acme", "user", "gus")
    promote(gateway, old)
    with StreamingLoad(client(gateway, "acme"), gateway.model, clients=2, user="gus") as load:
        wait_until(lambda: old in load.adapters, timeout_s=60, what="the clients are served by the old adapter")
        assert promote(gateway, new, reason="better")["previous_adapter_id"] == old
    assert load.failures == [] and load.completed > 0
    assert load.adapters == {old, new}
    assert load.adapters_after_mark == {new}  # every request begun after the promotion


def test_deleting_a_user_removes_their_adapters_at_once(gateway: Gateway, folders: Folders) -> None:
    first, second = folders(), folders()
    v1, v2 = (register(gateway, f, "globex", "user", "hal/9000") for f in (first, second))
    promote(gateway, v1)
    promote(gateway, v2)
    crew = register(gateway, folders(), "globex", "cohort", "crew")
    promote(gateway, crew)
    ok(admin(gateway, "PUT", "/admin/tenants/globex/cohorts/crew", json={"users": ["hal/9000", "ida"]}))
    assert served(gateway, "globex", "hal/9000") == v2

    path = f"/admin/users/{quote('hal/9000', safe='')}/data"
    deleted = ok(admin(gateway, "DELETE", path, params={"tenant": "globex"}))
    assert deleted["counts"]["adapters"] == 2 and deleted["counts"]["cohort_members"] == 1
    assert served(gateway, "globex", "hal/9000") is None  # neither hers nor her cohort's: she left it
    assert served(gateway, "globex", "ida") == crew
    assert not first.exists() and not second.exists()
    for gone in (v1, v2):
        error(admin(gateway, "GET", f"/admin/adapters/{gone}"), 404, "adapter_not_found")
    assert ok(admin(gateway, "GET", "/admin/adapters", params={"scope": "hal/9000"}))["data"] == []
    assert ok(admin(gateway, "GET", "/admin/tenants/globex/cohorts"))["data"] == [{"name": "crew", "users": ["ida"]}]
    reset(gateway, "globex", "cohort", "crew")


def test_bad_inputs_are_refused_with_their_codes(gateway: Gateway, folders: Folders, tmp_path: Path) -> None:
    good = folders()

    def broken(name: str, config: Any = None, weights: bytes | None = None) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        if config is not None:
            (folder / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if weights is not None:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        return folder

    config = json.loads((good / "adapter_config.json").read_text())
    no_weights = broken("no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    for folder, reason in (
        (tmp_path / "missing", "not a PEFT adapter folder"),
        (no_weights, "not a PEFT adapter folder"),
        (broken("prefix", {**config, "peft_type": "PREFIX_TUNING"}), "only LoRA"),
        (broken("dora", {**config, "use_dora": True}), "DoRA"),
        (broken("bias", {**config, "bias": "all"}), "trained biases"),
        (broken("no-rank", {k: v for k, v in config.items() if k != "r"}), "positive integer r"),
        (broken("zero-alpha", {**config, "lora_alpha": 0}), "positive lora_alpha"),
        (broken("not-json", "{r: 4"), "not readable JSON"),
        (broken("garbage", weights=b"\xff" * 64), "not a safetensors file"),
    ):
        body = {"tenant_id": "acme", "scope_kind": "user", "scope": "ann", "checkpoint_path": str(folder)}
        refused = error(admin(gateway, "POST", "/admin/adapters", json=body), 400, "invalid_adapter")
        assert reason in refused["message"] and refused["param"] == "checkpoint_path", refused

    valid = {"tenant_id": "acme", "scope_kind": "user", "scope": "ann", "checkpoint_path": str(good)}
    for change, status, code, param in (
        ({"scope_kind": "team"}, 400, "invalid_request", "scope_kind"),
        ({"scope_kind": "tenant"}, 400, "invalid_scope", "scope"),  # a tenant adapter's scope is its tenant
        ({"scope": ""}, 400, "invalid_request", "scope"),
        ({"scope": "x" * 257}, 400, "invalid_request", "scope"),
        ({"tenant_id": "nobody"}, 404, "tenant_not_found", "tenant_id"),
        ({"checkpoint_path": f"{good}\0"}, 400, "invalid_request", "checkpoint_path"),
        ({"base_version_id": "v-unknown"}, 404, "version_not_found", "base_version_id"),
        ({"colour": "blue"}, 400, "invalid_request", "colour"),
    ):
        refused = error(admin(gateway, "POST", "/admin/adapters", json={**valid, **change}), status, code)
        assert refused["param"] == param, (change, refused)
    assert ok(admin(gateway, "GET", "/admin/adapters", params={"scope": "ann", "status": "candidate"}))["data"] == []

    for method, path in (
        ("GET", "/admin/adapters/ad-unknown"),
        ("POST", "/admin/adapters/ad-unknown/promote"),
        ("POST", "/admin/adapters/ad-unknown/rollback"),
    ):
        error(admin(gateway, method, path), 404, "adapter_not_found")

    # Status transitions: promote a candidate, roll back to a retired adapter; nothing else.
    candidate = register(gateway, good, "globex", "user", "jo")
    error(admin(gateway, "POST", f"/admin/adapters/{candidate}/rollback"), 409, "version_state")
    promote(gateway, candidate)
    error(admin(gateway, "POST", f"/admin/adapters/{candidate}/promote"), 409, "version_state")
    error(admin(gateway, "POST", f"/admin/adapters/{candidate}/rollback"), 409, "version_state")
    reset(gateway, "globex", "user", "jo")
    error(admin(gateway, "POST", f"/admin/adapters/{candidate}/promote"), 409, "version_state")
    rejected = register(gateway, good, "globex", "user", "jo")
    with gateway.sessions().begin() as session:
        set_adapter_status(session, adapter_id=rejected, status="rejected", reason="worse than the base")
    for action in ("promote", "rollback"):
        error(admin(gateway, "POST", f"/admin/adapters/{rejected}/{action}"), 409, "version_state")
    # A folder gone since it was registered is refused, and nothing changes.
    vanishing = register(gateway, shutil.copytree(good, tmp_path / "vanishing"), "globex", "user", "jo")
    shutil.rmtree(tmp_path / "vanishing")
    error(admin(gateway, "POST", f"/admin/adapters/{vanishing}/promote"), 400, "invalid_adapter")
    assert status_of(gateway, vanishing) == "candidate" and served(gateway, "globex", "jo") is None

    for params, param in (
        ({"scope_kind": "team"}, "scope_kind"),
        ({"status": "done"}, "status"),
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"scope": ""}, "scope"),
    ):
        assert error(admin(gateway, "GET", "/admin/adapters", params=params), 400)["param"] == param
    error(admin(gateway, "GET", "/admin/adapters", params={"tenant": "nobody"}), 404, "tenant_not_found")

    reset_body = {"tenant_id": "acme", "scope_kind": "user", "scope": "ann"}
    for change, status, code in (
        ({"scope_kind": "everyone"}, 400, "invalid_request"),
        ({"scope_kind": "tenant", "scope": "globex"}, 400, "invalid_scope"),
        ({"tenant_id": "nobody"}, 404, "tenant_not_found"),
    ):
        error(admin(gateway, "POST", "/admin/adapters/reset", json={**reset_body, **change}), status, code)

    cohort = "/admin/tenants/acme/cohorts/delta"
    for users in ([], [""], ["x" * 257], [f"u{i}" for i in range(10_001)], "ann"):
        error(admin(gateway, "PUT", cohort, json={"users": users}), 400, "invalid_request")
    error(admin(gateway, "PUT", cohort, json={}), 400, "invalid_request")
    error(
        admin(gateway, "PUT", "/admin/tenants/nobody/cohorts/delta", json={"users": ["ann"]}), 404, "tenant_not_found"
    )
    error(admin(gateway, "GET", "/admin/tenants/nobody/cohorts"), 404, "tenant_not_found")
    error(admin(gateway, "DELETE", cohort), 404, "cohort_not_found")
    many = ok(admin(gateway, "PUT", cohort, json={"users": [f"u{i}" for i in range(10_000)]}))
    assert len(many["users"]) == 10_000
    ok(admin(gateway, "DELETE", cohort))


def test_every_change_is_audited(gateway: Gateway, folders: Folders) -> None:
    v1 = register(gateway, folders(), "globex", "user", "kim")
    v2 = register(gateway, folders(), "globex", "user", "kim")
    promote(gateway, v1, reason="first")
    promote(gateway, v2)
    rollback(gateway, v1)
    error(admin(gateway, "POST", f"/admin/adapters/{v1}/promote"), 409, "version_state")
    reset(gateway, "globex", "user", "kim")
    ok(admin(gateway, "PUT", "/admin/tenants/globex/cohorts/kims", json={"users": ["kim", "lee"]}))
    ok(admin(gateway, "DELETE", "/admin/tenants/globex/cohorts/kims"))

    registered = [e for e in audit(gateway, "adapter.register") if e["target"] in (v1, v2)]
    assert [(e["target"], e["status_code"]) for e in registered] == [(v2, 201), (v1, 201)]
    assert registered[0]["details"]["scope_kind"] == "user" and registered[0]["details"]["tenant_id"] == "globex"
    promotes = [e for e in audit(gateway, "adapter.promote") if e["target"] in (v1, v2)]
    assert [(e["target"], e["status_code"]) for e in promotes] == [(v1, 409), (v2, 200), (v1, 200)]
    assert promotes[-1]["details"]["reason"] == "first" and promotes[1]["details"]["previous_adapter_id"] == v1
    assert promotes[0]["details"]["code"] == "version_state"
    [rolled] = [e for e in audit(gateway, "adapter.rollback") if e["target"] == v1]
    assert rolled["details"]["previous_adapter_id"] == v2
    resets = [e for e in audit(gateway, "adapter.reset") if e["target"] == "kim"]
    assert resets[0]["details"]["retired_adapter_id"] == v1
    [set_] = [e for e in audit(gateway, "cohort.set") if e["target"] == "kims"]
    assert set_["details"] == {"tenant_id": "globex", "users": 2}
    [deleted] = [e for e in audit(gateway, "cohort.delete") if e["target"] == "kims"]
    assert deleted["details"] == {"tenant_id": "globex", "removed_users": 2}
    assert all(e["actor"].startswith("admin:") for e in registered + promotes + resets)
