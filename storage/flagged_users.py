"""End users an admin excluded from learning: every round drops their ratings (learner.user_weights).

A flag names a tenant's end user by the ``user`` field their requests carry; the user need not have
chatted yet. Flagging again replaces the reason; unflagging lets their later rounds' ratings train
again (ratings from while they were flagged were passed over by the rounds that ran then).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.dialect_insert import dialect_insert
from storage.models import FlaggedUser
from storage.times import utcnow

__all__ = ["FlaggedUserView", "flag_user", "flagged_users", "list_flagged_users", "unflag_user"]


@dataclass(frozen=True, slots=True)
class FlaggedUserView:
    tenant_id: str
    user_id: str
    reason: str | None
    flagged_by: str
    flagged_at: datetime


def flag_user(
    session: Session, *, tenant_id: str, user_id: str, reason: str | None, actor: str, now: datetime | None = None
) -> FlaggedUserView:
    """Exclude ``user_id`` of ``tenant_id`` from learning (again: the reason and time are replaced)."""
    values = {"reason": reason, "flagged_by": actor, "flagged_at": now or utcnow()}
    insert = dialect_insert(session, FlaggedUser).values(tenant_id=tenant_id, user_id=user_id, **values)
    session.execute(insert.on_conflict_do_update(index_elements=["tenant_id", "user_id"], set_=values))
    return FlaggedUserView(tenant_id, user_id, **values)  # type: ignore[arg-type]


def unflag_user(session: Session, *, tenant_id: str, user_id: str) -> bool:
    """Whether a flag was there to remove."""
    gone = session.execute(
        delete(FlaggedUser).where(FlaggedUser.tenant_id == tenant_id, FlaggedUser.user_id == user_id)
    )
    return bool(gone.rowcount)  # type: ignore[attr-defined]


def list_flagged_users(session: Session, *, tenant_id: str | None = None) -> tuple[FlaggedUserView, ...]:
    """Newest flag first."""
    query = select(FlaggedUser).order_by(FlaggedUser.flagged_at.desc(), FlaggedUser.user_id)
    if tenant_id is not None:
        query = query.where(FlaggedUser.tenant_id == tenant_id)
    return tuple(
        FlaggedUserView(row.tenant_id, row.user_id, row.reason, row.flagged_by, row.flagged_at)
        for row in session.scalars(query)
    )


def flagged_users(session: Session) -> frozenset[tuple[str, str]]:
    """Every ``(tenant_id, user_id)`` excluded from learning, for a round to drop their ratings."""
    return frozenset((t, u) for t, u in session.execute(select(FlaggedUser.tenant_id, FlaggedUser.user_id)))
