"""Per-user deletion tombstones, and keeping a deleted user's journaled records out of the database.

A deletion removes what the database holds, but a gateway's write-behind journal may still hold
records of that user written before the deletion (a backlog, a replay after a crash or an outage).
The tombstone (``data_deletions``) says when the user's data went: a completion that names the user
and was created at or before ``deleted_at`` is never written (``drop_deleted``), and feedback on it
is then orphaned and skipped like feedback on any unknown completion. A completion created after
the deletion is the user coming back, and is stored. ``created_at`` is the gateway's clock,
``deleted_at`` the admin's: clocks apart by more than the time between a request and its deletion
would let a record through.

On PostgreSQL a journal write and a deletion running at once could still cross: the writer reads
"no tombstone", the deletion commits, the writer commits the user's rows. So every journal batch
holds ``data_deletions`` in SHARE mode (``hold_off_deletions``) and a deletion takes ROW EXCLUSIVE
first (``lock_for_deletion``): the two modes conflict, so one waits for the other to commit, and
whichever runs second sees the first one's rows (READ COMMITTED reads afresh per statement). Journal
writers do not block each other (SHARE does not conflict with SHARE). SQLite transactions begin
IMMEDIATE (``storage.db``), which already runs them one at a time.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, tuple_
from sqlalchemy.orm import Session

from storage.models import DataDeletion
from storage.records import CompletionRecord
from storage.times import from_unix, utcnow

__all__ = [
    "DeletionView",
    "drop_deleted",
    "hold_off_deletions",
    "list_deletions",
    "lock_for_deletion",
    "record_deletion",
]

logger = logging.getLogger("tandem.log")


@dataclass(frozen=True, slots=True)
class DeletionView:
    id: int
    tenant_id: str
    end_user: str
    deleted_at: datetime
    actor: str
    counts: dict[str, Any]


def hold_off_deletions(session: Session) -> None:
    """Make a deletion wait until this transaction ends (PostgreSQL; see the module docstring)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("LOCK TABLE data_deletions IN SHARE MODE"))


def lock_for_deletion(session: Session) -> None:
    """Wait for journal writes in flight and hold new ones until this transaction ends (PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("LOCK TABLE data_deletions IN ROW EXCLUSIVE MODE"))


def record_deletion(
    session: Session, *, tenant_id: str, end_user: str, actor: str, counts: dict[str, int], now: datetime | None = None
) -> DeletionView:
    """Write the tombstone of a deletion."""
    row = DataDeletion(tenant_id=tenant_id, end_user=end_user, deleted_at=now or utcnow(), actor=actor, counts=counts)
    session.add(row)
    session.flush()
    return _view(row)


def list_deletions(session: Session, *, tenant_id: str, end_user: str) -> list[DeletionView]:
    """The user's tombstones, oldest first."""
    rows = session.scalars(
        select(DataDeletion)
        .where(DataDeletion.tenant_id == tenant_id, DataDeletion.end_user == end_user)
        .order_by(DataDeletion.id)
    )
    return [_view(row) for row in rows]


def drop_deleted(session: Session, records: Sequence[CompletionRecord]) -> list[CompletionRecord]:
    """``records`` without those of a user deleted at or after the record was created."""
    users = {(rec.tenant_id, rec.end_user) for rec in records if rec.end_user}
    if not users:
        return list(records)
    rows = session.execute(
        select(DataDeletion.tenant_id, DataDeletion.end_user, func.max(DataDeletion.deleted_at))
        .where(tuple_(DataDeletion.tenant_id, DataDeletion.end_user).in_(list(users)))
        .group_by(DataDeletion.tenant_id, DataDeletion.end_user)
    )
    latest = {(tenant_id, end_user): deleted_at for tenant_id, end_user, deleted_at in rows}
    kept = [rec for rec in records if not _deleted(rec, latest)]
    if len(kept) < len(records):
        logger.info("dropped %d journaled completions of deleted end users", len(records) - len(kept))
    return kept


def _deleted(rec: CompletionRecord, latest: dict[tuple[str, str], datetime]) -> bool:
    deleted_at = latest.get((rec.tenant_id, rec.end_user or ""))
    return deleted_at is not None and from_unix(rec.created_at) <= deleted_at


def _view(row: DataDeletion) -> DeletionView:
    return DeletionView(
        id=row.id,
        tenant_id=row.tenant_id,
        end_user=row.end_user,
        deleted_at=row.deleted_at,
        actor=row.actor,
        counts=row.counts,
    )
