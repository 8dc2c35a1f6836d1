"""/admin/adapters and /admin/tenants/{id}/cohorts: LoRA adapters per scope and cohorts (admin key only).

An adapter serves one scope of one tenant: a user (the ``user`` field of their chat requests), a
cohort (a named set of the tenant's users) or the whole tenant; a request gets the most specific
serving one (``server.adapter_directory``). Adapters trained elsewhere are registered as candidates
(the folder is checked first, as the local engine will read it), then promoted, rolled back to, or
their scope reset to the next less specific adapter. Every change is audited in its transaction and
served by this gateway from its next request on (other gateways: within TANDEM_ADAPTER_REFRESH_S).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from admin import schemas
from admin.audited import audited, read
from admin.deps import ActorDep, ReasonRequest, SessionsDep, in_thread
from admin.routes.tenants import get_tenant
from admin.routes.versions import ALLOWED, Action
from server.engines.local.lora import AdapterError, check_adapter_folder
from server.errors import ApiError
from server.routes.deps import NUL_ALLOWED, AdminDep, json_response
from server.schemas import CONFLICT, ERRORS, NulFreeStr
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
from storage.model_versions import get_version

log = logging.getLogger("tandem.adapters")

router = APIRouter()

AdapterStatus = Literal["candidate", "serving", "retired", "rejected"]
MAX_COHORT_USERS = 10_000

# A user or cohort scope may hold any characters, NUL included: both are stored NUL-safe, as the
# chat request's ``user`` field is.
Scope = Annotated[str, Field(min_length=1, max_length=256, description="The user, the cohort, or the tenant's id.")]
TenantId = Annotated[NulFreeStr, Field(min_length=1, max_length=64, description="The id of an existing tenant.")]
CohortName = Annotated[
    str,
    PathParam(min_length=1, max_length=256, description="The cohort's name.", json_schema_extra={NUL_ALLOWED: True}),
]
CohortUser = Annotated[str, Field(min_length=1, max_length=256)]


class ScopeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: TenantId
    scope_kind: ScopeKind
    scope: Scope


class RegisterAdapter(ScopeBody):
    checkpoint_path: NulFreeStr = Field(
        min_length=1, max_length=4096, description="The PEFT LoRA folder, as this gateway's engines see it."
    )
    base_version_id: NulFreeStr | None = Field(
        None, min_length=1, max_length=128, description="The model version it was trained over; null: the base."
    )


class CohortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    users: list[CohortUser] = Field(
        min_length=1, max_length=MAX_COHORT_USERS, description="The whole membership; a user of another cohort moves."
    )


def adapter_view(adapter: AdapterView) -> dict[str, Any]:
    return {**asdict(adapter), "object": "adapter"}


async def serve_changes(request: Request) -> None:
    """Serve a committed change from this gateway's next request on. Should the database fail the
    reread, the change stays committed and the periodic reread serves it (TANDEM_ADAPTER_REFRESH_S)."""
    try:
        await request.app.state.adapters.refresh()
    except SQLAlchemyError as exc:
        log.warning("could not reread the serving adapters after a change: %s", str(exc).splitlines()[0])


@router.get("/admin/adapters", response_model=schemas.AdapterList, responses=ERRORS)
async def get_adapters(
    _: AdminDep,
    sessions: SessionsDep,
    tenant: Annotated[str | None, Query(min_length=1, max_length=64, description="Only this tenant's.")] = None,
    scope_kind: ScopeKind | None = None,
    scope: Annotated[str | None, Query(min_length=1, max_length=256, json_schema_extra={NUL_ALLOWED: True})] = None,
    status: AdapterStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500, description="At most this many, newest first.")] = 100,
) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        if tenant is not None:
            get_tenant(session, tenant)
        found = list_adapters(session, tenant_id=tenant, scope_kind=scope_kind, scope=scope, status=status, limit=limit)
        return [adapter_view(a) for a in found]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.get("/admin/adapters/{adapter_id}", response_model=schemas.Adapter, responses=ERRORS)
async def get_one_adapter(adapter_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    return json_response(
        await in_thread(read, sessions, lambda session: adapter_view(adapter_or_404(session, adapter_id)))
    )


@router.post("/admin/adapters", status_code=201, response_model=schemas.Adapter, responses=ERRORS)
async def register_adapter(body: RegisterAdapter, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Record an adapter trained elsewhere as a candidate of its scope, once its folder checks out."""
    adapter_id = f"ad-{uuid.uuid4().hex[:12]}"
    model: str = request.app.state.adapters.model
    folder = os.path.abspath(body.checkpoint_path)  # as the engines will be told; links are kept

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, body.tenant_id)
        _check_scope(body)
        if body.base_version_id is not None:
            _check_base(session, body.base_version_id, model)
        check_folder(folder)
        adapter = record_adapter(
            session,
            adapter_id=adapter_id,
            model=model,
            tenant_id=body.tenant_id,
            scope_kind=body.scope_kind,
            scope=body.scope,
            checkpoint_path=folder,
            base_version_id=body.base_version_id,
        )
        details = {
            "tenant_id": body.tenant_id,
            "scope_kind": body.scope_kind,
            "checkpoint_path": folder,
            "base_version_id": body.base_version_id,
        }
        return adapter_view(adapter), details

    created = await audited(sessions, work, actor=actor, action="adapter.register", target=adapter_id, status_code=201)
    await serve_changes(request)
    return json_response(created, 201)


@router.post(
    "/admin/adapters/{adapter_id}/promote", response_model=schemas.AdapterSwap, responses={**ERRORS, **CONFLICT}
)
async def promote_adapter(
    adapter_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Serve a candidate for its scope; the scope's serving adapter retires."""
    return await _serve("promote", adapter_id, actor, sessions, request, body)


@router.post(
    "/admin/adapters/{adapter_id}/rollback", response_model=schemas.AdapterSwap, responses={**ERRORS, **CONFLICT}
)
async def rollback_adapter(
    adapter_id: str, actor: ActorDep, sessions: SessionsDep, request: Request, body: ReasonRequest | None = None
) -> Response:
    """Serve again an adapter that served before; the scope's serving adapter retires."""
    return await _serve("rollback", adapter_id, actor, sessions, request, body)


@router.post("/admin/adapters/reset", response_model=schemas.AdapterReset, responses=ERRORS)
async def reset_adapter_scope(body: ScopeBody, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Retire the scope's serving adapter: its requests go to the next less specific one, or the base."""
    model: str = request.app.state.adapters.model

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, body.tenant_id)
        _check_scope(body)
        retired = reset_scope(
            session, model=model, tenant_id=body.tenant_id, scope_kind=body.scope_kind, scope=body.scope
        )
        details = {"tenant_id": body.tenant_id, "scope_kind": body.scope_kind, "retired_adapter_id": retired}
        return {"retired_adapter_id": retired}, details

    answer = await audited(sessions, work, actor=actor, action="adapter.reset", target=body.scope)
    await serve_changes(request)
    return json_response(answer)


@router.get("/admin/tenants/{tenant_id}/cohorts", response_model=schemas.CohortList, responses=ERRORS)
async def get_cohorts(tenant_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        get_tenant(session, tenant_id)
        members = cohorts(session, tenant_id=tenant_id)
        return [{"name": name, "users": users} for (_tenant, name), users in sorted(members.items())]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.put("/admin/tenants/{tenant_id}/cohorts/{name:path}", response_model=schemas.Cohort, responses=ERRORS)
async def put_cohort(
    tenant_id: str, name: CohortName, body: CohortBody, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Make ``users`` the cohort's whole membership; a user in another cohort of the tenant moves."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant_id)
        members = set_cohort(session, tenant_id=tenant_id, cohort=name, users=body.users)
        # A count, not the ids: a membership may hold 10,000 users.
        return {"name": name, "users": members}, {"tenant_id": tenant_id, "users": len(members)}

    cohort = await audited(sessions, work, actor=actor, action="cohort.set", target=name)
    await serve_changes(request)
    return json_response(cohort)


@router.delete("/admin/tenants/{tenant_id}/cohorts/{name:path}", response_model=schemas.Cohort, responses=ERRORS)
async def delete_cohort(
    tenant_id: str, name: CohortName, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Empty the cohort: its members go to their tenant's adapter (the cohort's adapters stay)."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant_id)
        members = cohorts(session, tenant_id=tenant_id).get((tenant_id, name))
        if not members:
            raise ApiError(
                404,
                f"No cohort '{name}' in tenant '{tenant_id}' (it has no members).",
                param="name",
                code="cohort_not_found",
            )
        set_cohort(session, tenant_id=tenant_id, cohort=name, users=())
        return {"name": name, "users": []}, {"tenant_id": tenant_id, "removed_users": len(members)}

    cohort = await audited(sessions, work, actor=actor, action="cohort.delete", target=name)
    await serve_changes(request)
    return json_response(cohort)


async def _serve(
    action: Action,
    adapter_id: str,
    actor: str,
    sessions: sessionmaker[Session],
    request: Request,
    body: ReasonRequest | None,
) -> Response:
    reason = body.reason if body else None

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        adapter = adapter_or_404(session, adapter_id)
        refusal = ALLOWED[action].get(adapter.status, f"it is {adapter.status}")
        if refusal is not None:
            raise ApiError(
                409,
                f"Cannot {action.replace('rollback', 'roll back to')} {adapter_id}: {refusal}.",
                code="version_state",
            )
        check_folder(adapter.checkpoint_path)  # gone or changed since: refused while the scope's adapter serves on
        previous = serving_adapter(
            session,
            model=adapter.model,
            tenant_id=adapter.tenant_id,
            scope_kind=cast(ScopeKind, adapter.scope_kind),  # the table's check constraint
            scope=adapter.scope,
        )
        served = set_adapter_status(session, adapter_id=adapter_id, status="serving", reason=reason)
        previous_id = previous.id if previous is not None else None
        details = {
            "tenant_id": adapter.tenant_id,
            "scope_kind": adapter.scope_kind,
            "previous_adapter_id": previous_id,
            "reason": reason,
        }
        return {"adapter": adapter_view(served), "previous_adapter_id": previous_id}, details

    answer = await audited(sessions, work, actor=actor, action=f"adapter.{action}", target=adapter_id)
    await serve_changes(request)
    return json_response(answer)


def adapter_or_404(session: Session, adapter_id: str) -> AdapterView:
    try:
        return get_adapter(session, adapter_id=adapter_id)
    except NotFoundError as exc:
        raise ApiError(404, f"{exc.args[0]}.", param="adapter_id", code="adapter_not_found") from exc


def _check_scope(body: ScopeBody) -> None:
    if body.scope_kind == "tenant" and body.scope != body.tenant_id:
        raise ApiError(
            400,
            f"A tenant adapter's scope is its tenant's id ('{body.tenant_id}'), not '{body.scope}'.",
            param="scope",
            code="invalid_scope",
        )


def _check_base(session: Session, version_id: str, model: str) -> None:
    try:
        version = get_version(session, version_id=version_id)
    except NotFoundError as exc:
        raise ApiError(404, f"{exc.args[0]}.", param="base_version_id", code="version_not_found") from exc
    if version.model != model:
        raise ApiError(
            400,
            f"{version_id} is a version of {version.model}, not of the served {model}.",
            param="base_version_id",
            code="wrong_model",
        )


def check_folder(folder: str) -> None:
    try:
        check_adapter_folder(Path(folder))
    except AdapterError as exc:
        raise ApiError(400, str(exc), param="checkpoint_path", code="invalid_adapter") from exc
