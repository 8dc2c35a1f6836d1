"""Rated feedback since a watermark: what a training round learns from.

The watermark is a database sequence, not a timestamp
------------------------------------------------------
``feedback.updated_at`` is the time a gateway stamped on the rating event. Gateways' clocks differ
slightly, and the conversation log replays its journal after a crash or a database outage, so a row
can be *written* long after rows with newer timestamps were. A round that cut at "updated_at <= T"
would skip such a late row forever; a grace window only narrows the hole (a replay can be hours late).

So every insert of a ``feedback`` row, and every update that changes its ``revision``, is numbered by
the database itself: triggers (migration 0002) append ``(seq, completion_id, choice_index, revision)``
to ``feedback_changes``, whose ``seq`` is an auto-increment (SQLite ``AUTOINCREMENT``, a PostgreSQL
sequence). The watermark is a ``seq``: a round consumes the changes in ``(since, watermark]``, a row
written late gets a new, higher number and the next round collects it, whatever its timestamp says.

Numbers are handed out at insert time but become visible at commit, and on PostgreSQL two writers
can commit out of order (seq 11 visible while seq 10 is still in flight). ``collect_feedback`` fixes
its upper bound under ``LOCK TABLE feedback_changes IN SHARE MODE`` in its own short transaction:
the lock waits for in-flight feedback writers and holds new ones out for one ``max(seq)``, so every
number up to the bound is committed (or rolled back) when the bound is read. SQLite has one writer at
a time, so numbers are committed in order. The collect itself must then read in READ COMMITTED (the
default), so that it sees everything committed before the bound was taken.

A revision is new data: a user who changes a rating from ``up`` to ``down`` wants the model to learn
the new verdict, so a changed rating is collected again by the next round (at its new revision),
while an unchanged row is collected by exactly one round. Each choice is returned once per batch, at
the revision of its latest change up to the bound; a change that lands after the bound is left to
the next round. Filters (tenant, end user, max age) pass rows over for good: the watermark covers
everything of the model up to it.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import Row, Select, func, select, text
from sqlalchemy.orm import Session, aliased

from storage.codec import decode_logprobs, decode_token_ids
from storage.learning_errors import LearningStateError
from storage.models import Completion, CompletionChoice, ConversationSession, EndUser, Feedback, FeedbackChange
from storage.records import WeightSpan
from storage.times import utcnow


@dataclass(frozen=True, slots=True)
class FeedbackItem:
    """One rated choice with everything a training sample needs."""

    seq: int
    completion_id: str
    choice_index: int
    tenant_id: str
    model: str
    user_id: str | None
    session_id: str | None
    request_messages: list[dict[str, Any]]
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    rollout_log_probs: list[float]
    temperature: float  # the request's sampling temperature (0: greedy)
    weight_versions: tuple[WeightSpan, ...]
    response_text: str
    finish_reason: str
    score: float
    rating: str | None
    comment: str | None
    corrected_answer: str | None
    revision: int
    rated_at: datetime
    completion_created_at: datetime


@dataclass(frozen=True, slots=True)
class FeedbackBatch:
    """Items in change order; ``watermark`` is what ``since`` should be next time."""

    since: int
    watermark: int
    items: tuple[FeedbackItem, ...]


def collect_feedback(
    session: Session,
    *,
    model: str,
    since: int,
    tenant_id: str | None = None,
    end_user: str | None = None,
    max_age: timedelta | None = None,
    limit: int | None = None,
    until: int | None = None,
    end_users: Sequence[str] | None = None,
) -> FeedbackBatch:
    """Rated choices of ``model`` whose rating changed after watermark ``since``.

    Args:
        since: the previous round's watermark (``last_watermark``); 0 for the first round.
        tenant_id, end_user: only this tenant's / end user's feedback (the others are passed over).
        end_users: only these end users' feedback (a cohort).
        max_age: only completions created at most this long ago.
        limit: at most this many items; the watermark then stops at the last one returned.
        until: no change numbered above this (a history read up to a round's watermark).

    Raises:
        LearningStateError: a PostgreSQL session not in READ COMMITTED (it could miss rows).
    """
    upper = _committed_horizon(session)
    if until is not None:
        upper = min(upper, until)
    if upper <= since:
        return FeedbackBatch(since=since, watermark=since, items=())
    query = _feedback_query(model=model, since=since, upper=upper)
    if tenant_id is not None:
        query = query.where(Completion.tenant_id == tenant_id)
    if end_user is not None:
        query = query.where(EndUser.external_id == end_user)
    if end_users is not None:
        query = query.where(EndUser.external_id.in_(list(end_users)))
    if max_age is not None:
        query = query.where(Completion.created_at >= utcnow() - max_age)
    if limit is not None:
        query = query.limit(limit)
    items = tuple(_feedback_item(row) for row in session.execute(query))
    full = limit is not None and len(items) == limit
    return FeedbackBatch(since=since, watermark=items[-1].seq if full else upper, items=items)


@dataclass(frozen=True, slots=True)
class RatingRecord:
    """One rated choice's current verdict, for baselines (no tokens)."""

    user_id: str | None
    rating: Literal["up", "down"] | None
    score: float


def rating_history(session: Session, *, model: str) -> list[RatingRecord]:
    """Every rated choice of ``model`` at its current revision, oldest rating first."""
    query = (
        select(EndUser.external_id, Feedback.rating, Feedback.score)
        .join(Completion, Completion.id == Feedback.completion_id)
        .outerjoin(EndUser, EndUser.id == Completion.end_user_id)
        .where(Completion.model == model)
        .order_by(Feedback.updated_at)
    )
    return [
        RatingRecord(user_id, cast(Literal["up", "down"] | None, rating), score)  # the column holds only these
        for user_id, rating, score in session.execute(query)
    ]


def _committed_horizon(session: Session) -> int:
    """The highest change number below which every number is committed (see the module docstring)."""
    highest = select(func.coalesce(func.max(FeedbackChange.seq), 0))
    bind = session.get_bind()
    if bind.dialect.name != "postgresql":
        return int(session.scalar(highest) or 0)
    level = session.connection().get_isolation_level()
    if level != "READ COMMITTED":
        raise LearningStateError(f"collect_feedback needs READ COMMITTED, the session runs {level}")
    # Own short transaction: feedback writers wait for one statement, not for the whole collect.
    with bind.engine.begin() as connection:
        connection.execute(text("LOCK TABLE feedback_changes IN SHARE MODE"))
        return int(connection.scalar(highest) or 0)


def _feedback_query(*, model: str, since: int, upper: int) -> Select[Any]:
    latest = (
        select(
            FeedbackChange.completion_id,
            FeedbackChange.choice_index,
            func.max(FeedbackChange.seq).label("seq"),
        )
        .where(FeedbackChange.seq > since, FeedbackChange.seq <= upper)
        .group_by(FeedbackChange.completion_id, FeedbackChange.choice_index)
        .subquery()
    )
    change = aliased(FeedbackChange)
    return (
        select(
            latest.c.seq,
            Feedback,
            Completion.tenant_id,
            Completion.model,
            Completion.request_messages,
            Completion.prompt_token_ids,
            Completion.sampling_params,
            Completion.created_at.label("completion_created_at"),
            CompletionChoice.token_ids,
            CompletionChoice.logprobs,
            CompletionChoice.weight_versions,
            CompletionChoice.text,
            CompletionChoice.finish_reason,
            EndUser.external_id.label("user_id"),
            ConversationSession.session_key,
        )
        .join(change, change.seq == latest.c.seq)
        .join(
            Feedback,
            (Feedback.completion_id == latest.c.completion_id) & (Feedback.choice_index == latest.c.choice_index),
        )
        # A revision newer than the bound belongs to the next round, which will see its change row.
        .where(Feedback.revision == change.revision)
        .join(Completion, Completion.id == Feedback.completion_id)
        .join(
            CompletionChoice,
            (CompletionChoice.completion_id == Feedback.completion_id)
            & (CompletionChoice.choice_index == Feedback.choice_index),
        )
        .outerjoin(EndUser, EndUser.id == Completion.end_user_id)
        .outerjoin(ConversationSession, ConversationSession.id == Completion.session_id)
        .where(Completion.model == model)
        .order_by(latest.c.seq)
    )


def _feedback_item(row: Row[Any]) -> FeedbackItem:
    feedback: Feedback = row.Feedback
    return FeedbackItem(
        seq=row.seq,
        completion_id=feedback.completion_id,
        choice_index=feedback.choice_index,
        tenant_id=row.tenant_id,
        model=row.model,
        user_id=row.user_id,
        session_id=row.session_key,
        request_messages=row.request_messages,
        prompt_token_ids=decode_token_ids(row.prompt_token_ids),
        response_token_ids=decode_token_ids(row.token_ids),
        rollout_log_probs=decode_logprobs(row.logprobs),
        temperature=float(row.sampling_params.get("temperature", 1.0)),
        weight_versions=tuple(WeightSpan(**span) for span in row.weight_versions),
        response_text=row.text,
        finish_reason=row.finish_reason,
        score=feedback.score,
        rating=feedback.rating,
        comment=feedback.comment,
        corrected_answer=feedback.corrected_answer,
        revision=feedback.revision,
        rated_at=feedback.updated_at,
        completion_created_at=row.completion_created_at,
    )
