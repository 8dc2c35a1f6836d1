"""/admin/tenants: create, list, show, and revoke every key of a tenant (admin key only)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from admin import schemas  # by module: its Tenant is the answer, storage's the row
from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.api_keys import count_active_keys_by_tenant, revoke_tenant_keys
from storage.models import Tenant
from storage.tenants import ensure_tenant, list_tenants, tenant_by_name

router = APIRouter()

TENANT_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class CreateTenant(BaseModel):
    id: str = Field(min_length=1, max_length=64, pattern=TENANT_ID, description="Stable id, used in keys and data.")
    name: str | None = Field(None, min_length=1, max_length=200, description="Display name; default: the id.")


def tenant_view(tenant: Tenant, active_keys: int) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": _iso(tenant.created_at), "active_keys": active_keys}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def get_tenant(session: Session, tenant_id: str) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise ApiError(404, f"No tenant with id '{tenant_id}'.", param="tenant_id", code="tenant_not_found")
    return tenant


@router.post("/admin/tenants", status_code=201, response_model=schemas.Tenant, responses={**ERRORS, **CONFLICT})
async def create_tenant(body: CreateTenant, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    name = body.name or body.id

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        if session.get(Tenant, body.id) is not None:
            raise ApiError(409, f"The tenant '{body.id}' exists already.", param="id", code="tenant_exists")
        if tenant_by_name(session, name) is not None:
            raise ApiError(409, f"Another tenant is named '{name}'.", param="name", code="tenant_exists")
        return tenant_view(ensure_tenant(session, body.id, name), 0), {"name": name}

    created = await audited(sessions, work, actor=actor, action="tenant.create", target=body.id, status_code=201)
    return json_response(created, 201)


@router.get("/admin/tenants", response_model=schemas.TenantList, responses=ERRORS)
async def get_tenants(_: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        active = count_active_keys_by_tenant(session)
        return [tenant_view(t, active.get(t.id, 0)) for t in list_tenants(session)]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.get("/admin/tenants/{tenant_id}", response_model=schemas.Tenant, responses=ERRORS)
async def get_one_tenant(tenant_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> dict[str, Any]:
        tenant = get_tenant(session, tenant_id)
        return tenant_view(tenant, count_active_keys_by_tenant(session).get(tenant.id, 0))

    return json_response(await in_thread(read, sessions, work))


@router.post("/admin/tenants/{tenant_id}/revoke", response_model=schemas.RevokedTenant, responses=ERRORS)
async def revoke_tenant(tenant_id: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Revoke every active key of the tenant; its data stays."""

    def work(session: Session) -> tuple[tuple[dict[str, Any], list[str]], dict[str, Any]]:
        tenant = get_tenant(session, tenant_id)
        revoked = revoke_tenant_keys(session, tenant.id)
        ids = [key.id for key in revoked]
        return (tenant_view(tenant, 0) | {"revoked_keys": ids}, [k.key_hash for k in revoked]), {"keys": ids}

    view, hashes = await audited(sessions, work, actor=actor, action="tenant.revoke", target=tenant_id)
    for key_hash in hashes:
        request.app.state.auth.forget(key_hash)
    return json_response(view)
