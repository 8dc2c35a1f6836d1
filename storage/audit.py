"""The admin audit log: every admin action, who did it, on what, and how it ended.

Write the entry in the same transaction as the action's effect, so an effect is never unaudited and
an entry never claims an effect that was rolled back. Refused actions (4xx) are recorded too, on
their own, with the status they got.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from storage.models import AdminAuditEntry
from storage.times import utcnow

_AUDIT: Table = AdminAuditEntry.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class AdminActionView:
    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    details: dict[str, Any]
    status_code: int


def record_admin_action(
    session: Session,
    *,
    actor: str,
    action: str,
    target: str | None,
    details: dict[str, Any] | None = None,
    status_code: int = 200,
    now: datetime | None = None,
) -> None:
    """Append one entry. ``action`` is a short verb phrase such as ``round.cancel``; ``details`` is JSON."""
    session.execute(
        _AUDIT.insert().values(
            at=now or utcnow(),
            actor=actor,
            action=action,
            target=target,
            details=details or {},
            status_code=status_code,
        )
    )


def list_admin_actions(
    session: Session, *, limit: int = 100, before: int | None = None, action: str | None = None
) -> tuple[AdminActionView, ...]:
    """Newest first; ``before`` is an entry id (the last id of the previous page) to page back from."""
    query = select(_AUDIT).order_by(_AUDIT.c.id.desc()).limit(limit)
    if before is not None:
        query = query.where(_AUDIT.c.id < before)
    if action is not None:
        query = query.where(_AUDIT.c.action == action)
    return tuple(AdminActionView(**row._asdict()) for row in session.execute(query))
