"""/admin/users/{user}/flag: exclude an end user's ratings from learning, or let them train again.

A flagged user's ratings are dropped by every round (base and personal) from the next one on
(``learner.user_weights`` has the other rules that keep one user from moving the shared model);
``GET /admin/flagged-users`` lists the flags. The user need not have chatted yet.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.tenants import get_tenant
from admin.routes.users import Tenant, User
from admin.schemas import FlaggedUser, FlaggedUserList
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS
from storage.flagged_users import FlaggedUserView, flag_user, list_flagged_users, unflag_user
from storage.tenants import DEFAULT_TENANT_ID

router = APIRouter()

FLAG_PATH = "/admin/users/{user:path}/flag"


class FlagBody(BaseModel):
    reason: str | None = Field(None, max_length=2000, description="Why, for the next operator to read")


def _shown(flag: FlaggedUserView) -> dict[str, Any]:
    return {
        "object": "flagged_user",
        "tenant_id": flag.tenant_id,
        "user": flag.user_id,
        "reason": flag.reason,
        "flagged_by": flag.flagged_by,
        "flagged_at": flag.flagged_at,
    }


@router.put(FLAG_PATH, response_model=FlaggedUser, responses=ERRORS)
async def flag(
    user: User, body: FlagBody, actor: ActorDep, sessions: SessionsDep, tenant: Tenant = DEFAULT_TENANT_ID
) -> Response:
    """Exclude the end user's ratings from learning (again: the reason is replaced)."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant)
        flagged = flag_user(session, tenant_id=tenant, user_id=user, reason=body.reason, actor=actor)
        return _shown(flagged), {"tenant_id": tenant, "reason": body.reason}

    return json_response(await audited(sessions, work, actor=actor, action="user.flag", target=user))


@router.delete(FLAG_PATH, response_model=FlaggedUser, responses=ERRORS)
async def unflag(user: User, actor: ActorDep, sessions: SessionsDep, tenant: Tenant = DEFAULT_TENANT_ID) -> Response:
    """Let the end user's ratings train again, from the next round on; answers the flag that was removed."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant)
        current = [f for f in list_flagged_users(session, tenant_id=tenant) if f.user_id == user]
        if not current or not unflag_user(session, tenant_id=tenant, user_id=user):
            raise ApiError(
                404, f"End user '{user}' of tenant '{tenant}' is not flagged.", param="user", code="not_flagged"
            )
        return _shown(current[0]), {"tenant_id": tenant}

    return json_response(await audited(sessions, work, actor=actor, action="user.unflag", target=user))


@router.get("/admin/flagged-users", response_model=FlaggedUserList, responses=ERRORS)
async def list_all(
    _: AdminDep,
    sessions: SessionsDep,
    tenant: Annotated[str | None, Query(min_length=1, max_length=64, description="Only this tenant's")] = None,
) -> Response:
    """Every flagged end user, newest flag first."""

    def work(session: Session) -> dict[str, Any]:
        return {"object": "list", "data": [_shown(f) for f in list_flagged_users(session, tenant_id=tenant)]}

    return json_response(await in_thread(read, sessions, work))
