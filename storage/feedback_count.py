"""How much new feedback a model has: what decides whether a scheduled round is due.

A cheap count next to ``collect_feedback``: it reads the same change numbers (see
``storage.feedback_collect``) but no token ids, and takes no lock, so a rating committing right now
may be counted on the next check instead of this one.

All functions run inside the caller's transaction.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import Completion, FeedbackChange

__all__ = ["count_feedback_since"]


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
