"""What every admin route needs: the admin key's identity as the audit actor, and the database."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Depends, Request
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session, sessionmaker

from server.database_errors import database_call
from server.errors import ApiError
from server.routes.deps import AdminDep
from storage.audit import record_admin_action


async def _actor(request: Request, admin: AdminDep) -> str:
    """Who acts, for the audit log: a fingerprint of the admin key (never the key itself)."""
    _scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
    return "admin:" + hashlib.sha256(key.strip().encode()).hexdigest()[:12]


async def _sessions(request: Request) -> sessionmaker[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions  # set by the server's lifespan
    return sessions


ActorDep = Annotated[str, Depends(_actor)]


class ReasonRequest(BaseModel):
    """The optional body of a mutating admin action: why, for the audit log."""

    reason: str | None = Field(default=None, max_length=1000, description="Why, for the audit log.")


SessionsDep = Annotated[sessionmaker[Session], Depends(_sessions)]


# Blocking database work off the event loop: a refused value is a 400, an outage a logged 503.
in_thread = database_call


async def audit_refusal(
    sessions: sessionmaker[Session], error: ApiError, *, actor: str, action: str, target: str | None
) -> ApiError:
    """Record a refused action with its status, and hand the error back to raise."""

    def write() -> None:
        with sessions.begin() as session:
            details = {"error": error.message, "code": error.code}
            record_admin_action(
                session, actor=actor, action=action, target=target, details=details, status_code=error.status
            )

    await in_thread(write)
    return error
