"""/admin/tools and /admin/tenants/{id}/tools: the tools this gateway runs itself (TANDEM_TOOLS) and the
tenants it runs them for (server/server_tools.py). Enabling applies on this gateway at the tenant's
next request, on the others within TANDEM_AUTH_KEY_TTL_S (the key cache carries it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from admin import schemas
from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.tenants import get_tenant
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS
from server.server_tools import ServerTools
from storage.tenants import set_server_tools, tenants_by_server_tool

router = APIRouter()


class TenantToolsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(max_length=64, description="names from GET /admin/tools; [] turns them off")


def _loaded(request: Request) -> ServerTools | None:
    tools: ServerTools | None = request.app.state.server_tools
    return tools


@router.get("/admin/tools", response_model=schemas.ServerToolList, responses=ERRORS)
async def list_tools(_: AdminDep, sessions: SessionsDep, request: Request) -> Response:
    loaded = _loaded(request)
    enabled = await in_thread(read, sessions, tenants_by_server_tool)
    data = [
        {
            "name": item.name,
            "description": item.description,
            "parameters": item.parameters,
            "source": item.source or item.name,
            "timeout_s": item.timeout_s,
            "tenants": enabled.get(item.name, []),
        }
        for item in (loaded.registry if loaded else ())
    ]
    return json_response({"object": "list", "data": data, "max_steps": loaded.max_steps if loaded else 0})


@router.get("/admin/tenants/{tenant_id}/tools", response_model=schemas.TenantTools, responses=ERRORS)
async def get_tenant_tools(tenant_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    def work(session: Session) -> dict[str, Any]:
        return {"tenant_id": tenant_id, "tools": list(get_tenant(session, tenant_id).server_tools)}

    return json_response(await in_thread(read, sessions, work))


@router.put("/admin/tenants/{tenant_id}/tools", response_model=schemas.TenantTools, responses=ERRORS)
async def set_tenant_tools(
    tenant_id: str, body: TenantToolsBody, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    loaded = _loaded(request)
    known = {item.name for item in loaded.registry} if loaded else set()
    if unknown := sorted(set(body.tools) - known):
        offered = ", ".join(sorted(known)) or "none (set TANDEM_TOOLS)"
        raise ApiError(400, f"This gateway runs no tool named '{unknown[0]}'; its tools: {offered}.", param="tools")

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        tenant = get_tenant(session, tenant_id)
        set_server_tools(session, tenant, body.tools)
        return {"tenant_id": tenant.id, "tools": list(tenant.server_tools)}, {"tools": tenant.server_tools}

    view = await audited(sessions, work, actor=actor, action="tenant.tools.set", target=tenant_id)
    request.app.state.auth.recheck_all()
    request.app.state.auth.forget()  # the keyless quick start's identity carries the default tenant's
    return json_response(view)
