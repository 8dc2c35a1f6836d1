"""Run an admin action in one database transaction together with its audit entry.

A refused action (an ApiError with a 4xx status) is audited too, in a transaction of its own, with
the status it got (admin.deps.audit_refusal). A database outage is a 503, never a 500.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from admin.deps import audit_refusal, in_thread
from server.errors import ApiError
from storage.audit import record_admin_action

T = TypeVar("T")

# SQLite's busy timeout does not cover a read transaction that turns into a write after another
# connection committed (the conversation log commits all the time): it fails at once, and a fresh
# transaction succeeds. PostgreSQL never raises this.
SQLITE_BUSY_RETRIES = 4


def _sqlite_busy(exc: OperationalError) -> bool:
    return isinstance(exc.orig, sqlite3.OperationalError) and "database is locked" in str(exc.orig)


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

    def once() -> T:
        with sessions.begin() as session:
            result, details = work(session)
            record_admin_action(
                session, actor=actor, action=action, target=target, details=details, status_code=status_code
            )
            return result

    def run() -> T:
        for _ in range(SQLITE_BUSY_RETRIES):
            try:
                return once()
            except OperationalError as exc:
                if not _sqlite_busy(exc):
                    raise
        return once()

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
