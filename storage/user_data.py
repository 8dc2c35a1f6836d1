"""One end user's data: exported whole, or deleted in one transaction that leaves a tombstone.

An end user is the ``user`` field of a chat request, as the client sent it, within one tenant
(``end_users``: tenant, external id). Their data is:

- the ``end_users`` row;
- their sessions: the conversations whose first identified turn named them (``sessions.end_user_id``);
- their completions: those that name them, and the turns of their sessions that name nobody (a
  later turn's prompt repeats the earlier turns); each with its choices (text, token ids, logprobs,
  weight spans), the current rating of each choice, every rating event, and the rating change
  numbers the learner's watermark counts (``feedback_changes``).

A turn that names another user stays theirs, even inside this user's session: it loses only its
link to the deleted session and turn (``SET NULL``). Deleting also writes a tombstone
(``storage.data_deletions``), which keeps the user's journaled records written before it out of
the database; the tombstone itself (tenant, user, when, who, counts) is the record of the deletion
and stays.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, or_, select
from sqlalchemy.orm import Session

from storage.adapters import AdapterView, delete_user_adapters, leave_cohorts, list_adapters
from storage.canaries import delete_user_canaries
from storage.completions import CompletionView, completion_views
from storage.data_deletions import DeletionView, list_deletions, lock_for_deletion, record_deletion
from storage.learning_errors import NotFoundError
from storage.models import (
    Base,
    Completion,
    CompletionChoice,
    ConversationSession,
    EndUser,
    Feedback,
    FeedbackChange,
    FeedbackEvent,
)

__all__ = ["SessionView", "UserData", "delete_user_data", "export_user_data"]


@dataclass(frozen=True, slots=True)
class SessionView:
    session_key: str
    created_at: datetime
    last_seen_at: datetime
    turn_count: int


@dataclass(frozen=True, slots=True)
class UserData:
    """Everything stored about one end user; ``deletions`` are earlier deletions of the same user."""

    tenant_id: str
    end_user: str
    first_seen_at: datetime
    sessions: tuple[SessionView, ...]
    completions: tuple[CompletionView, ...]
    deletions: tuple[DeletionView, ...]
    adapters: tuple[AdapterView, ...]  # their personal LoRA adapters' versions (the folders are theirs too)


def export_user_data(session: Session, *, tenant_id: str, end_user: str) -> UserData:
    """Everything stored about ``end_user`` of ``tenant_id``, completions oldest first.

    Raises:
        NotFoundError: no such end user in that tenant (never seen, or deleted).
    """
    user = _end_user(session, tenant_id, end_user)
    sessions = session.scalars(
        select(ConversationSession)
        .where(ConversationSession.end_user_id == user.id)
        .order_by(ConversationSession.created_at, ConversationSession.id)
    )
    return UserData(
        tenant_id=tenant_id,
        end_user=end_user,
        first_seen_at=user.created_at,
        sessions=tuple(SessionView(s.session_key, s.created_at, s.last_seen_at, s.turn_count) for s in sessions),
        completions=tuple(completion_views(session, _owned_completions(user.id))),
        deletions=tuple(list_deletions(session, tenant_id=tenant_id, end_user=end_user)),
        adapters=list_adapters(session, tenant_id=tenant_id, scope_kind="user", scope=end_user, limit=1_000_000),
    )


def delete_user_data(
    session: Session, *, tenant_id: str, end_user: str, actor: str, now: datetime | None = None
) -> DeletionView:
    """Delete everything stored about ``end_user`` and write the tombstone; returns it (with counts).

    Raises:
        NotFoundError: no such end user in that tenant (never seen, or deleted already).
    """
    lock_for_deletion(session)  # first: journal writes in flight land before the rows are read
    user = _end_user(session, tenant_id, end_user)
    owned = _owned_completions(user.id)
    completion_ids = select(Completion.id).where(owned)
    counts = {
        # Children first: the completions they hang off select them.
        "feedback_changes": _delete(session, FeedbackChange, FeedbackChange.completion_id.in_(completion_ids)),
        "feedback_events": _delete(session, FeedbackEvent, FeedbackEvent.completion_id.in_(completion_ids)),
        "feedback": _delete(session, Feedback, Feedback.completion_id.in_(completion_ids)),
        "completion_choices": _delete(session, CompletionChoice, CompletionChoice.completion_id.in_(completion_ids)),
        "completions": _delete(session, Completion, owned),
        "sessions": _delete(session, ConversationSession, ConversationSession.end_user_id == user.id),
        "end_users": _delete(session, EndUser, EndUser.id == user.id),
        "canaries": delete_user_canaries(session, tenant_id=tenant_id, end_user=end_user),
        "adapters": len(delete_user_adapters(session, tenant_id=tenant_id, end_user=end_user)),
        "cohort_members": leave_cohorts(session, tenant_id=tenant_id, end_user=end_user),
    }
    return record_deletion(session, tenant_id=tenant_id, end_user=end_user, actor=actor, counts=counts, now=now)


def _end_user(session: Session, tenant_id: str, end_user: str) -> EndUser:
    user = session.scalars(
        select(EndUser).where(EndUser.tenant_id == tenant_id, EndUser.external_id == end_user)
    ).one_or_none()
    if user is None:
        raise NotFoundError(f"no end user {end_user!r} in tenant {tenant_id!r}")
    return user


def _owned_completions(user_id: int) -> ColumnElement[bool]:
    """The user's completions: naming them, or naming nobody inside one of their sessions."""
    their_sessions = select(ConversationSession.id).where(ConversationSession.end_user_id == user_id)
    return or_(
        Completion.end_user_id == user_id,
        and_(Completion.end_user_id.is_(None), Completion.session_id.in_(their_sessions)),
    )


def _delete(session: Session, model: type[Base], where: ColumnElement[bool]) -> int:
    # Core-style delete: nothing of these rows is loaded in the session, so there is nothing to sync.
    result: Any = session.execute(delete(model).where(where).execution_options(synchronize_session=False))
    return int(result.rowcount)
