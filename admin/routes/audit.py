"""GET /admin/audit: every admin action, newest first."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from admin.deps import SessionsDep, in_thread
from admin.routes.pages import Limit, page
from admin.schemas import AuditPage
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS, INT64_MAX
from storage.audit import AdminActionView, list_admin_actions

router = APIRouter()


@router.get("/admin/audit", response_model=AuditPage, responses=ERRORS)
async def list_audit(
    _: AdminDep,
    sessions: SessionsDep,
    action: Annotated[str | None, Query(max_length=64, description="Only this action, e.g. run.cancel.")] = None,
    before: Annotated[int | None, Query(ge=1, le=INT64_MAX, description="next_before of the previous page.")] = None,
    limit: Limit = 100,
) -> Response:
    def read() -> tuple[AdminActionView, ...]:
        with sessions() as session:
            return list_admin_actions(session, limit=limit + 1, before=before, action=action)

    rows = await in_thread(read)
    return json_response(page(rows, limit, lambda entry: entry.id))
