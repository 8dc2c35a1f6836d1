"""/admin/users/{user}/data: export everything stored about one end user, or delete it (admin key only).

``user`` is the ``user`` field of the end user's chat requests, as the client sent it (any
characters, percent-encoded in the path); ``tenant`` picks whose end user, the default tenant unless
given. What counts as the user's data is ``storage.user_data``'s docstring; the deletion's
tombstone and its effect on journaled records are ``storage.data_deletions``'.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.adapters import serve_changes
from admin.routes.tenants import get_tenant
from admin.schemas import UserDataDeletion, UserDataExport
from server.errors import ApiError
from server.routes.deps import NUL_ALLOWED, AdminDep, json_response
from server.schemas import ERRORS
from storage.adapters import list_adapters
from storage.learning_errors import NotFoundError
from storage.tenants import DEFAULT_TENANT_ID
from storage.user_data import delete_user_data, export_user_data

router = APIRouter()

JOURNAL_FLUSH_S = 5.0
# ``:path``: an end user id may hold a "/" (sent as %2F, which the router sees decoded).
DATA_PATH = "/admin/users/{user:path}/data"

# Any characters, NUL included: the chat request's `user` field is stored NUL-safe.
User = Annotated[
    str,
    Path(
        min_length=1,
        max_length=256,
        description="The end user: the `user` field of their chat requests.",
        json_schema_extra={NUL_ALLOWED: True},
    ),
]
Tenant = Annotated[str, Query(min_length=1, max_length=64, description="The end user's tenant.")]


@router.get(DATA_PATH, response_model=UserDataExport, responses=ERRORS)
async def export_data(
    user: User, _: AdminDep, sessions: SessionsDep, request: Request, tenant: Tenant = DEFAULT_TENANT_ID
) -> Response:
    """Everything stored about the end user, in one JSON document."""
    await _land_journal(request)

    def work(session: Session) -> dict[str, Any]:
        get_tenant(session, tenant)
        try:
            data = export_user_data(session, tenant_id=tenant, end_user=user)
        except NotFoundError as exc:
            raise _not_found(user, tenant) from exc
        return {
            "object": "user_data",
            "tenant_id": data.tenant_id,
            "user": data.end_user,
            "first_seen_at": data.first_seen_at,
            "sessions": data.sessions,
            "completions": data.completions,
            "deletions": data.deletions,
            "adapters": data.adapters,
        }

    return json_response(await in_thread(read, sessions, work))


@router.delete(DATA_PATH, response_model=UserDataDeletion, responses=ERRORS)
async def delete_data(
    user: User, actor: ActorDep, sessions: SessionsDep, request: Request, tenant: Tenant = DEFAULT_TENANT_ID
) -> Response:
    """Delete everything stored about the end user in one transaction; answers the tombstone.

    Their adapter stops serving at once (before the transaction), and its folders go after it."""
    await _land_journal(request)
    request.app.state.adapters.forget_user(tenant, user)
    folders: list[str] = []

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        get_tenant(session, tenant)
        adapters = list_adapters(session, tenant_id=tenant, scope_kind="user", scope=user, limit=1_000_000)
        folders.extend(a.checkpoint_path for a in adapters)
        try:
            deletion = delete_user_data(session, tenant_id=tenant, end_user=user, actor=actor)
        except NotFoundError as exc:
            raise _not_found(user, tenant) from exc
        body = {
            "object": "user_data.deletion",
            "tenant_id": tenant,
            "user": user,
            "deleted_at": deletion.deleted_at,
            "counts": deletion.counts,
        }
        return body, {"tenant_id": tenant, "counts": deletion.counts}

    body = await audited(sessions, work, actor=actor, action="user_data.delete", target=user)
    # A reread begun before the deletion committed may have put the adapter back meanwhile: reread.
    await serve_changes(request)
    await asyncio.to_thread(_remove_folders, folders)
    return json_response(body)


def _remove_folders(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)  # one already gone (or never on this host) is fine


async def _land_journal(request: Request) -> None:
    """This gateway's journaled records go to the database first: the export then has them, and the
    deletion takes them with the rest (other gateways' journals are the tombstone's job)."""
    log = request.app.state.completions.log
    if log.db_available:  # while the database is away, waiting would only delay the 503
        await log.flush(JOURNAL_FLUSH_S)


def _not_found(user: str, tenant: str) -> ApiError:
    return ApiError(
        404, f"No end user '{user}' in tenant '{tenant}' (never seen, or deleted).", param="user", code="user_not_found"
    )
