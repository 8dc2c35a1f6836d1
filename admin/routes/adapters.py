"""LoRA adapters per scope and cohorts: list, register, promote, roll back, reset; define cohorts.

Promotion changes who is served what from this gateway's next request on (its adapter directory is
reread after every change; other gateways reread within ``TANDEM_ADAPTER_REFRESH_S``). Requests
already decoding finish with the adapter they started with. Every change is audited.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from pathlib import Path as FilePath
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from admin.audited import audited, read
from admin.deps import ActorDep, ReasonRequest, SessionsDep, in_thread
from admin.routes.tenants import get_tenant
from admin.schemas import Adapter, AdapterList, AdapterPromoted, AdapterReset, Cohort, CohortList
from server.engines.local.lora import AdapterError, check_adapter_folder
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.adapters import (
    AdapterView,
    ScopeKind,
    cohorts,
    get_adapter,
    list_adapters,
    record_adapter,
    reset_scope,
    serving_adapter,
    set_adapter_status,
    set_cohort,
)
from storage.learning_errors import NotFoundError

router = APIRouter()

Status = Literal["candidate", "serving", "retired", "rejected"]
Action = Literal["promote", "rollback"]
# Which statuses each action may start from (as for model versions); the message says what to do instead.
ALLOWED: dict[Action, dict[str, str | None]] = {
    "promote": {
        "candidate": None,
        "serving": "it already serves",
        "retired": "it served before: roll back to it instead",
        "rejected": "it was rejected",
    },
    "rollback": {
        "retired": None,
        "serving": "it already serves",
        "candidate": "it never served: promote it instead",
        "rejected": "it was rejected",
    },
}
Name = Annotated[str, Field(min_length=1, max_length=256)]


class ScopeRequest(BaseModel):
    tenant_id: Annotated[str, Field(min_length=1, max_length=64)]
    scope_kind: ScopeKind
    scope: Name


class RegisterAdapter(ScopeRequest):
    checkpoint_path: Annotated[str, Field(min_length=1, max_length=4096, description="A PEFT LoRA folder")]
    base_version_id: Annotated[
        str | None, Field(max_length=128, description="The base it was trained over; none: served over any base")
    ] = None


class CohortMembers(BaseModel):
    users: Annotated[list[Name], Field(max_length=10_000, description="Replaces the whole membership")]


async def _refresh(request: Request) -> None:
    await request.app.state.adapters.refresh()


def _public(adapter: AdapterView) -> dict[str, Any]:
    return {"object": "adapter", **asdict(adapter)}


def _not_found(adapter_id: str) -> ApiError:
    return ApiError(404, f"No adapter '{adapter_id}'.", param="adapter_id", code="adapter_not_found")


@router.get("/admin/adapters", response_model=AdapterList, responses=ERRORS)
async def list_all(
    _: AdminDep,
    sessions: SessionsDep,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    scope_kind: ScopeKind | None = None,
    scope: Annotated[str | None, Query(max_length=256)] = None,
    status: Status | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    """Newest first, filtered by tenant, scope and status."""

    def work(session: Session) -> list[dict[str, Any]]:
        found = list_adapters(session, tenant_id=tenant, scope_kind=scope_kind, scope=scope, status=status, limit=limit)
        return [_public(a) for a in found]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.get("/admin/adapters/{adapter_id}", response_model=Adapter, responses=ERRORS)
async def get_one(adapter_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> dict[str, Any]:
        try:
            return _public(get_adapter(session, adapter_id=adapter_id))
        except NotFoundError as exc:
            raise _not_found(adapter_id) from exc

    return json_response(await in_thread(read, sessions, work))


@router.post("/admin/adapters", response_model=Adapter, responses=ERRORS)
async def register(body: RegisterAdapter, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Record an adapter trained elsewhere as a candidate of its scope (promote it to serve it)."""
    _check_scope(body)
    folder = FilePath(body.checkpoint_path)
    try:
        await in_thread(check_adapter_folder, folder)
    except AdapterError as exc:
        raise ApiError(400, str(exc), param="checkpoint_path", code="invalid_adapter") from exc
    adapter_id = f"ad-{uuid.uuid4().hex[:12]}"
    model = request.app.state.chat.model_name

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, body.tenant_id)
        adapter = record_adapter(
            session,
            adapter_id=adapter_id,
            model=model,
            tenant_id=body.tenant_id,
            scope_kind=body.scope_kind,
            scope=body.scope,
            checkpoint_path=str(folder),
            base_version_id=body.base_version_id,
        )
        return _public(adapter), {"tenant_id": body.tenant_id, "scope": f"{body.scope_kind}:{body.scope}"}

    return json_response(await audited(sessions, work, actor=actor, action="adapter.register", target=adapter_id))


@router.post("/admin/adapters/{adapter_id}/promote", response_model=AdapterPromoted, responses={**ERRORS, **CONFLICT})
async def promote(
    adapter_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Serve a candidate to its scope from the next request on (its previous adapter retires)."""
    return await _change("promote", adapter_id, actor, sessions, request, body)


@router.post("/admin/adapters/{adapter_id}/rollback", response_model=AdapterPromoted, responses={**ERRORS, **CONFLICT})
async def rollback(
    adapter_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Serve again an adapter that served its scope before."""
    return await _change("rollback", adapter_id, actor, sessions, request, body)


async def _change(
    action: Action,
    adapter_id: str,
    actor: str,
    sessions: SessionsDep,
    request: Request,
    body: ReasonRequest | None,
) -> Response:
    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        try:
            adapter = get_adapter(session, adapter_id=adapter_id)
        except NotFoundError as exc:
            raise _not_found(adapter_id) from exc
        refusal = ALLOWED[action].get(adapter.status, f"it is {adapter.status}")
        if refusal is not None:
            verb = action.replace("rollback", "roll back to")
            raise ApiError(409, f"Cannot {verb} {adapter_id}: {refusal}.", code="version_state")
        scope: dict[str, Any] = {
            "model": adapter.model,
            "tenant_id": adapter.tenant_id,
            "scope_kind": adapter.scope_kind,
            "scope": adapter.scope,
        }
        previous = serving_adapter(session, **scope)
        reason = body.reason if body else None
        promoted = set_adapter_status(session, adapter_id=adapter_id, status="serving", reason=reason)
        previous_id = previous.id if previous else None
        answer = {"adapter": _public(promoted), "previous_adapter_id": previous_id}
        return answer, {**scope, "previous_adapter_id": previous_id, "reason": reason}

    answer = await audited(sessions, work, actor=actor, action=f"adapter.{action}", target=adapter_id)
    await _refresh(request)
    return json_response(answer)


@router.post("/admin/adapters/reset", response_model=AdapterReset, responses=ERRORS)
async def reset(body: ScopeRequest, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Back to the next less specific adapter (cohort, tenant) or the base: the scope's adapter retires."""
    _check_scope(body)
    model = request.app.state.chat.model_name

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, body.tenant_id)
        retired = reset_scope(
            session, model=model, tenant_id=body.tenant_id, scope_kind=body.scope_kind, scope=body.scope
        )
        return {"retired_adapter_id": retired}, {**body.model_dump(), "retired_adapter_id": retired}

    answer = await audited(
        sessions, work, actor=actor, action="adapter.reset", target=f"{body.scope_kind}:{body.scope}"
    )
    await _refresh(request)
    return json_response(answer)


def _check_scope(body: ScopeRequest) -> None:
    if body.scope_kind == "tenant" and body.scope != body.tenant_id:
        raise ApiError(400, "A tenant scope is the tenant itself: scope must equal tenant_id.", param="scope")


# ---- cohorts ----

CohortName = Annotated[str, Path(min_length=1, max_length=256)]
TenantId = Annotated[str, Path(min_length=1, max_length=64)]


@router.get("/admin/tenants/{tenant}/cohorts", response_model=CohortList, responses=ERRORS)
async def list_cohorts(tenant: TenantId, _: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        get_tenant(session, tenant)
        return [
            {"name": name, "users": users} for (_, name), users in sorted(cohorts(session, tenant_id=tenant).items())
        ]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.put("/admin/tenants/{tenant}/cohorts/{name}", response_model=Cohort, responses=ERRORS)
async def put_cohort(
    tenant: TenantId, name: CohortName, body: CohortMembers, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Make ``users`` the cohort's whole membership; a user in another cohort of the tenant moves here."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant)
        members = set_cohort(session, tenant_id=tenant, cohort=name, users=body.users)
        return {"name": name, "users": members}, {"tenant_id": tenant, "users": len(members)}

    answer = await audited(sessions, work, actor=actor, action="cohort.set", target=name)
    await _refresh(request)
    return json_response(answer)


@router.delete("/admin/tenants/{tenant}/cohorts/{name}", response_model=Cohort, responses=ERRORS)
async def delete_cohort(
    tenant: TenantId, name: CohortName, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Empty the cohort: its members fall back to their tenant's adapter or the base."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant)
        members = cohorts(session, tenant_id=tenant).get((tenant, name))
        if not members:
            raise ApiError(404, f"No cohort '{name}' in tenant '{tenant}'.", param="name", code="cohort_not_found")
        set_cohort(session, tenant_id=tenant, cohort=name, users=[])
        return {"name": name, "users": []}, {"tenant_id": tenant, "users_removed": len(members)}

    answer = await audited(sessions, work, actor=actor, action="cohort.delete", target=name)
    await _refresh(request)
    return json_response(answer)
