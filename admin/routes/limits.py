"""/admin/tenants/{id}/limits and /admin/keys/{id}/limits: request limits (server/rate_limits.py).

A tenant without limits of its own gets the deployment's defaults (TANDEM_TENANT_*); a key without
limits of its own is limited only by its tenant's. Changes apply on this gateway at the next request
and on the others within TANDEM_AUTH_KEY_TTL_S.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.keys import get_api_key
from admin.routes.tenants import get_tenant
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS
from storage.rate_limits import Limits, Scope, clear_limits, get_limits, set_limits

router = APIRouter()


class LimitsBody(BaseModel):
    """Each limit is a positive number, or null for none of that kind."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=1, le=2**31 - 1)
    tokens_per_minute: int | None = Field(None, ge=1, le=2**31 - 1, description="prompt tokens + max_tokens x n")
    max_concurrent_requests: int | None = Field(None, ge=1, le=2**31 - 1, description="per gateway")


class LimitsView(LimitsBody):
    scope: str
    id: str
    source: str = Field(description="'stored': set through this API; 'default': the deployment's (tenants only)")


def _view(scope: Scope, subject_id: str, stored: Limits | None, default: Limits | None) -> dict[str, Any]:
    limits = stored or default or Limits()
    return {"scope": scope, "id": subject_id, "source": "stored" if stored else "default", **asdict(limits)}


def _routes(scope: Scope, path: str, exists: Callable[[Session, str], object]) -> None:
    """GET, PUT and DELETE of one scope's limits; ``exists`` raises the 404 of an unknown id."""

    def default(request: Request) -> Limits | None:
        return request.app.state.limits.tenant_default if scope == "tenant" else None

    @router.get(path, response_model=LimitsView, responses=ERRORS, name=f"get_{scope}_limits")
    async def get(subject_id: str, _: AdminDep, sessions: SessionsDep, request: Request) -> Response:
        def work(session: Session) -> Limits | None:
            exists(session, subject_id)
            return get_limits(session, scope, subject_id)

        stored = await in_thread(read, sessions, work)
        return json_response(_view(scope, subject_id, stored, default(request)))

    @router.put(path, response_model=LimitsView, responses=ERRORS, name=f"set_{scope}_limits")
    async def put(
        subject_id: str, body: LimitsBody, actor: ActorDep, sessions: SessionsDep, request: Request
    ) -> Response:
        limits = Limits(**body.model_dump())

        def work(session: Session) -> tuple[Limits, dict[str, Any]]:
            exists(session, subject_id)
            return set_limits(session, scope, subject_id, limits), body.model_dump()

        stored = await audited(sessions, work, actor=actor, action=f"{scope}.limits.set", target=subject_id)
        request.app.state.auth.recheck_all()
        return json_response(_view(scope, subject_id, stored, None))

    @router.delete(path, response_model=LimitsView, responses=ERRORS, name=f"clear_{scope}_limits")
    async def delete(subject_id: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
        def work(session: Session) -> tuple[None, dict[str, Any]]:
            exists(session, subject_id)
            return None, {"cleared": clear_limits(session, scope, subject_id)}

        await audited(sessions, work, actor=actor, action=f"{scope}.limits.clear", target=subject_id)
        request.app.state.auth.recheck_all()
        return json_response(_view(scope, subject_id, None, default(request)))


_routes("tenant", "/admin/tenants/{subject_id}/limits", get_tenant)
_routes("key", "/admin/keys/{subject_id}/limits", get_api_key)
