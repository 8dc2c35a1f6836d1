"""/admin/keys: create (the key is in that answer only), list, show and revoke API keys (admin key only).

Listings carry a hint of the key, ``tdm-`` and its first 4 secret characters, never more.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from admin import schemas  # by module: its ApiKey is the answer, storage's the row
from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.tenants import get_tenant
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS, NulFreeStr
from storage.api_keys import KEY_PREFIX, create_api_key, list_api_keys, revoke_api_key
from storage.models import ApiKey

router = APIRouter()

HINT_SECRET_CHARS = 4


class CreateKey(BaseModel):
    tenant: NulFreeStr = Field(min_length=1, max_length=64, description="The id of an existing tenant.")
    name: NulFreeStr = Field("default", min_length=1, max_length=200, description="A label for the key.")


def key_view(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "object": "api_key",
        "tenant_id": key.tenant_id,
        "name": key.name,
        "hint": key.prefix[: len(KEY_PREFIX) + HINT_SECRET_CHARS] + "…",
        "created_at": key.created_at.isoformat(),
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
    }


def get_api_key(session: Session, key_id: str) -> ApiKey:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise ApiError(404, f"No API key with id '{key_id}'.", param="key_id", code="key_not_found")
    return key


@router.post("/admin/keys", status_code=201, response_model=schemas.CreatedKey, responses=ERRORS)
async def create_key(body: CreateKey, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        tenant = get_tenant(session, body.tenant)
        plaintext, key = create_api_key(session, tenant_name=tenant.name, name=body.name)
        return key_view(key) | {"key": plaintext}, {"key_id": key.id, "name": body.name}

    created = await audited(sessions, work, actor=actor, action="key.create", target=body.tenant, status_code=201)
    request.app.state.auth.forget()  # the first key ends keyless use at once
    return json_response(created, 201)


@router.get("/admin/keys", response_model=schemas.ApiKeyList, responses=ERRORS)
async def get_keys(_: AdminDep, sessions: SessionsDep, tenant: str | None = None) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        if tenant is not None:
            get_tenant(session, tenant)
        return [key_view(k) for k in list_api_keys(session, tenant_id=tenant)]

    return json_response({"object": "list", "data": await in_thread(read, sessions, work)})


@router.get("/admin/keys/{key_id}", response_model=schemas.ApiKey, responses=ERRORS)
async def get_key(key_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    return json_response(await in_thread(read, sessions, lambda session: key_view(get_api_key(session, key_id))))


@router.delete("/admin/keys/{key_id}", response_model=schemas.ApiKey, responses=ERRORS)
async def revoke_key(key_id: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Revoke a key (idempotent: revoking again keeps the first time)."""

    def work(session: Session) -> tuple[tuple[dict[str, Any], str], dict[str, Any]]:
        key = get_api_key(session, key_id)
        revoke_api_key(session, key.id)  # updates ``key``: the session holds one object per row
        return (key_view(key), key.key_hash), {"tenant_id": key.tenant_id}

    view, key_hash = await audited(sessions, work, actor=actor, action="key.revoke", target=key_id)
    request.app.state.auth.forget(key_hash)
    return json_response(view)
