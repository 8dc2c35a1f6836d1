"""How much new feedback a model has: what decides whether a scheduled round is due.

A cheap count next to ``collect_feedback``: it reads the same change numbers (see
``storage.feedback_collect``) but no token ids, and takes no lock, so a rating committing right now
may be counted on the next check instead of this one.

All functions run inside the caller's transaction.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import Completion, EndUser, FeedbackChange

__all__ = ["count_feedback_by_user", "count_feedback_since"]


def count_feedback_since(session: Session, *, model: str, since: int) -> int:
    """Rated choices of ``model`` whose rating changed after watermark ``since`` (each counted once)."""
    changed = (
        select(FeedbackChange.completion_id, FeedbackChange.choice_index)
        .join(Completion, Completion.id == FeedbackChange.completion_id)
        .where(FeedbackChange.seq > since, Completion.model == model)
        .distinct()
        .subquery()
    )
    return int(session.scalar(select(func.count()).select_from(changed)) or 0)


def count_feedback_by_user(
    session: Session, *, model: str, since: int, tenant_id: str | None = None, end_user: str | None = None
) -> dict[tuple[str, str], int]:
    """(tenant id, end user) -> their rated choices of ``model`` changed after ``since`` (users named only)."""
    changed = (
        select(Completion.tenant_id, EndUser.external_id, FeedbackChange.completion_id, FeedbackChange.choice_index)
        .join(Completion, Completion.id == FeedbackChange.completion_id)
        .join(EndUser, EndUser.id == Completion.end_user_id)
        .where(FeedbackChange.seq > since, Completion.model == model)
        .distinct()
    )
    if tenant_id is not None:
        changed = changed.where(Completion.tenant_id == tenant_id)
    if end_user is not None:
        changed = changed.where(EndUser.external_id == end_user)
    rows = changed.subquery()
    grouped = select(rows.c.tenant_id, rows.c.external_id, func.count()).group_by(rows.c.tenant_id, rows.c.external_id)
    return {(tenant, user): int(count) for tenant, user, count in session.execute(grouped)}
