"""Run an admin action in one database transaction together with its audit entry.

A refused action (an ApiError with a 4xx status) is audited too, in a transaction of its own, with
the status it got (admin.deps.audit_refusal). A database outage is a 503, never a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from admin.deps import audit_refusal, in_thread
from server.errors import ApiError
from storage.audit import record_admin_action

T = TypeVar("T")


async def audited(
    sessions: sessionmaker[Session],
    work: Callable[[Session], tuple[T, dict[str, Any]]],
    *,
    actor: str,
    action: str,
    target: str | None,
    status_code: int = 200,
) -> T:
    """Run ``work`` (returning its result and the audit details) and record ``action`` with it."""

    # SQLite transactions begin IMMEDIATE (storage.db), so a read-then-write here waits for the lock.
    def run() -> T:
        with sessions.begin() as session:
            result, details = work(session)
            record_admin_action(
                session, actor=actor, action=action, target=target, details=details, status_code=status_code
            )
            return result

    try:
        return await in_thread(run)
    except ApiError as error:
        if not 400 <= error.status < 500:
            raise
        raise await audit_refusal(sessions, error, actor=actor, action=action, target=target) from error


def read(sessions: sessionmaker[Session], work: Callable[[Session], T]) -> T:
    """``work`` in a session of its own; for ``in_thread``."""
    with sessions() as session:
        return work(session)
