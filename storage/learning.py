"""What the learner and the admin API store and read: rated feedback since a watermark, training
rounds and model versions.

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

Rounds are idempotent because the watermark only moves when a round *succeeds*
(``finish_round(status="succeeded", watermark_to=...)``): a failed or abandoned round leaves it where
it was, and the re-run collects the same data again. One round runs per model at a time: a unique
partial index on ``training_rounds(model) WHERE status = 'running'`` is the lock, released when the
round finishes or when ``fail_stale_rounds`` marks a round whose worker stopped heart-beating failed.
A failed round cannot succeed later, so a zombie worker cannot move the watermark under a re-run.

Promotion keeps exactly one serving version per model: ``set_version_status(status="serving")``
locks the model's version rows, retires the serving one and promotes the new one in the caller's
transaction; a unique partial index on ``model_versions(model) WHERE status = 'serving'`` backs it.
All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Row, Select, Table, func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from storage.codec import decode_logprobs, decode_token_ids
from storage.models import (
    Completion,
    CompletionChoice,
    ConversationSession,
    EndUser,
    Feedback,
    FeedbackChange,
    ModelVersion,
    TrainingRound,
)
from storage.records import WeightSpan
from storage.times import utcnow

VersionStatus = Literal["candidate", "serving", "retired", "rejected"]
RoundTrigger = Literal["schedule", "manual"]
RoundOutcome = Literal["succeeded", "failed"]

_VERSIONS: Table = ModelVersion.__table__  # type: ignore[assignment]
_ROUNDS: Table = TrainingRound.__table__  # type: ignore[assignment]


class LearningStateError(RuntimeError):
    """A round or version is not in a state that allows the requested change."""


class RoundBusyError(LearningStateError):
    """Another round of the same model is running."""


class NotFoundError(LookupError):
    """No round or version with that id."""


# feedback


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
) -> FeedbackBatch:
    """Rated choices of ``model`` whose rating changed after watermark ``since``.

    Args:
        since: the previous round's watermark (``last_watermark``); 0 for the first round.
        tenant_id, end_user: only this tenant's / end user's feedback (the others are passed over).
        max_age: only completions created at most this long ago.
        limit: at most this many items; the watermark then stops at the last one returned.

    Raises:
        LearningStateError: a PostgreSQL session not in READ COMMITTED (it could miss rows).
    """
    upper = _committed_horizon(session)
    if upper <= since:
        return FeedbackBatch(since=since, watermark=since, items=())
    query = _feedback_query(model=model, since=since, upper=upper)
    if tenant_id is not None:
        query = query.where(Completion.tenant_id == tenant_id)
    if end_user is not None:
        query = query.where(EndUser.external_id == end_user)
    if max_age is not None:
        query = query.where(Completion.created_at >= utcnow() - max_age)
    if limit is not None:
        query = query.limit(limit)
    items = tuple(_feedback_item(row) for row in session.execute(query))
    full = limit is not None and len(items) == limit
    return FeedbackBatch(since=since, watermark=items[-1].seq if full else upper, items=items)


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


# training rounds


@dataclass(frozen=True, slots=True)
class TrainingRoundView:
    id: str
    model: str
    status: str
    trigger: str
    base_version_id: str | None
    produced_version_id: str | None
    watermark_from: int | None
    watermark_to: int | None
    samples_collected: int | None
    samples_trained: int | None
    config: dict[str, Any]
    metrics: dict[str, Any]
    error: str | None
    worker_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None


def queue_round(
    session: Session,
    *,
    model: str,
    trigger: RoundTrigger,
    config: dict[str, Any] | None = None,
    base_version_id: str | None = None,
    round_id: str | None = None,
) -> TrainingRoundView:
    """A round waiting for a worker (``start_round(round_id=...)`` claims it)."""
    round_id = round_id or f"round-{uuid.uuid4().hex}"
    session.execute(
        _ROUNDS.insert().values(
            **_new_round(model, trigger, config, base_version_id, round_id), status="queued", created_at=utcnow()
        )
    )
    return get_round(session, round_id=round_id)


def start_round(
    session: Session,
    *,
    model: str,
    worker_id: str,
    trigger: RoundTrigger = "manual",
    round_id: str | None = None,
    config: dict[str, Any] | None = None,
    base_version_id: str | None = None,
    now: datetime | None = None,
) -> TrainingRoundView:
    """Mark a round running on ``worker_id``, from the last succeeded round's watermark.

    Claims the queued round ``round_id`` when given (and it exists), else creates a new one.

    Raises:
        RoundBusyError: another round of ``model`` is running.
        LearningStateError: ``round_id`` exists but is not queued.
    """
    now = now or utcnow()
    running = {
        "status": "running",
        "worker_id": worker_id,
        "started_at": now,
        "heartbeat_at": now,
        "watermark_from": last_watermark(session, model=model),
    }
    round_id = round_id or f"round-{uuid.uuid4().hex}"
    existing = session.scalar(select(_ROUNDS.c.status).where(_ROUNDS.c.id == round_id))
    if existing is not None and existing != "queued":
        raise LearningStateError(f"round {round_id} is {existing}, not queued")
    try:
        with session.begin_nested():  # a savepoint: a busy model must not spoil the caller's transaction
            if existing is None:
                values = _new_round(model, trigger, config, base_version_id, round_id)
                session.execute(_ROUNDS.insert().values(**values, **running, created_at=now))
            else:
                session.execute(update(_ROUNDS).where(_ROUNDS.c.id == round_id).values(**running))
    except IntegrityError as exc:
        raise RoundBusyError(f"another round of {model} is running") from exc
    return get_round(session, round_id=round_id)


def _new_round(
    model: str, trigger: str, config: dict[str, Any] | None, base_version_id: str | None, round_id: str
) -> dict[str, Any]:
    return {
        "id": round_id,
        "model": model,
        "trigger": trigger,
        "config": config or {},
        "metrics": {},
        "base_version_id": base_version_id,
    }


def heartbeat_round(session: Session, *, round_id: str, now: datetime | None = None) -> bool:
    """Record that the round's worker is alive; False when the round is no longer running (stop)."""
    result = session.execute(
        update(_ROUNDS)
        .where(_ROUNDS.c.id == round_id, _ROUNDS.c.status == "running")
        .values(heartbeat_at=now or utcnow())
    )
    return _rowcount(result) == 1


def finish_round(
    session: Session,
    *,
    round_id: str,
    status: RoundOutcome,
    watermark_to: int | None = None,
    metrics: dict[str, Any] | None = None,
    error: str | None = None,
    samples_collected: int | None = None,
    samples_trained: int | None = None,
    produced_version_id: str | None = None,
    now: datetime | None = None,
) -> TrainingRoundView:
    """End a running round; a succeeded one moves the model's watermark to ``watermark_to``.

    Raises:
        ValueError: a succeeded round without ``watermark_to``.
        LearningStateError: the round is not running (finished, cancelled, or declared dead).
    """
    if status == "succeeded" and watermark_to is None:
        raise ValueError("a succeeded round needs the watermark it consumed up to")
    values: dict[str, Any] = {"status": status, "finished_at": now or utcnow(), "error": error}
    optional = {
        "watermark_to": watermark_to,
        "metrics": metrics,
        "samples_collected": samples_collected,
        "samples_trained": samples_trained,
        "produced_version_id": produced_version_id,
    }
    values.update({key: value for key, value in optional.items() if value is not None})
    _transition(session, round_id, ("running",), values)
    return get_round(session, round_id=round_id)


def cancel_round(session: Session, *, round_id: str, now: datetime | None = None) -> TrainingRoundView:
    """Cancel a queued or running round (a running worker learns it from ``heartbeat_round``)."""
    _transition(session, round_id, ("queued", "running"), {"status": "cancelled", "finished_at": now or utcnow()})
    return get_round(session, round_id=round_id)


def _transition(session: Session, round_id: str, allowed: tuple[str, ...], values: dict[str, Any]) -> None:
    # One conditional UPDATE, so a finish racing fail_stale_rounds has exactly one winner.
    result = session.execute(
        update(_ROUNDS).where(_ROUNDS.c.id == round_id, _ROUNDS.c.status.in_(allowed)).values(**values)
    )
    if _rowcount(result) != 1:
        current = get_round(session, round_id=round_id)
        raise LearningStateError(f"round {round_id} is {current.status}, not {' or '.join(allowed)}")


def fail_stale_rounds(
    session: Session, *, timeout: timedelta, now: datetime | None = None
) -> tuple[TrainingRoundView, ...]:
    """Mark failed every running round whose last heartbeat is older than ``timeout``.

    Their data stays unconsumed (the watermark did not move), so re-running them loses nothing and
    counts nothing twice; their model's round lock is released.
    """
    now = now or utcnow()
    cutoff = now - timeout
    stale = session.scalars(
        select(_ROUNDS.c.id).where(_ROUNDS.c.status == "running", _ROUNDS.c.heartbeat_at < cutoff)
    ).all()
    failed = []
    for round_id in stale:
        result = session.execute(
            update(_ROUNDS)
            .where(_ROUNDS.c.id == round_id, _ROUNDS.c.status == "running", _ROUNDS.c.heartbeat_at < cutoff)
            .values(status="failed", finished_at=now, error=f"worker stopped heart-beating (timeout {timeout})")
        )
        if _rowcount(result) == 1:
            failed.append(get_round(session, round_id=round_id))
    return tuple(failed)


def last_watermark(session: Session, *, model: str) -> int:
    """The watermark of the model's succeeded rounds (0 before the first)."""
    query = select(func.max(_ROUNDS.c.watermark_to)).where(_ROUNDS.c.model == model, _ROUNDS.c.status == "succeeded")
    return int(session.scalar(query) or 0)


def get_round(session: Session, *, round_id: str) -> TrainingRoundView:
    row = session.execute(select(_ROUNDS).where(_ROUNDS.c.id == round_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no round {round_id}")
    return TrainingRoundView(**row._asdict())


def list_rounds(
    session: Session, *, model: str | None = None, status: str | None = None, limit: int = 100
) -> tuple[TrainingRoundView, ...]:
    """Newest first."""
    query = select(_ROUNDS).order_by(_ROUNDS.c.created_at.desc(), _ROUNDS.c.id).limit(limit)
    if model is not None:
        query = query.where(_ROUNDS.c.model == model)
    if status is not None:
        query = query.where(_ROUNDS.c.status == status)
    return tuple(TrainingRoundView(**row._asdict()) for row in session.execute(query))


# model versions


@dataclass(frozen=True, slots=True)
class ModelVersionView:
    id: str
    model: str
    parent_id: str | None
    checkpoint_path: str
    sha256: str | None
    status: str
    status_reason: str | None
    watermark: int | None
    metrics: dict[str, Any]
    evaluation: dict[str, Any]
    created_at: datetime
    promoted_at: datetime | None
    retired_at: datetime | None


def record_model_version(
    session: Session,
    *,
    version_id: str,
    model: str,
    checkpoint_path: str,
    sha256: str | None = None,
    parent_id: str | None = None,
    watermark: int | None = None,
    metrics: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> ModelVersionView:
    """A new candidate version (promote it with ``set_version_status``)."""
    session.execute(
        _VERSIONS.insert().values(
            id=version_id,
            model=model,
            parent_id=parent_id,
            checkpoint_path=checkpoint_path,
            sha256=sha256,
            status="candidate",
            watermark=watermark,
            metrics=metrics or {},
            evaluation=evaluation or {},
            created_at=now or utcnow(),
        )
    )
    return get_version(session, version_id=version_id)


def set_version_status(
    session: Session,
    *,
    version_id: str,
    status: VersionStatus,
    reason: str | None = None,
    evaluation: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> ModelVersionView:
    """Change a version's status; ``serving`` retires the model's serving version in the same transaction.

    Promoting an earlier (retired) version is a rollback.

    Raises:
        NotFoundError: no such version.
    """
    now = now or utcnow()
    model = get_version(session, version_id=version_id).model
    values: dict[str, Any] = {"status": status, "status_reason": reason}
    if evaluation is not None:
        values["evaluation"] = evaluation
    if status == "serving":
        _retire_serving(session, model, version_id, now)
        values.update(promoted_at=now, retired_at=None)
    elif status == "retired":
        values["retired_at"] = now
    session.execute(update(_VERSIONS).where(_VERSIONS.c.id == version_id).values(**values))
    return get_version(session, version_id=version_id)


def _retire_serving(session: Session, model: str, keep: str, now: datetime) -> None:
    # Locking every version row of the model serialises concurrent promotions; the UPDATE after it
    # is a new statement, so it sees (and retires) what a promotion that went first committed.
    session.execute(select(_VERSIONS.c.id).where(_VERSIONS.c.model == model).with_for_update()).all()
    session.execute(
        update(_VERSIONS)
        .where(_VERSIONS.c.model == model, _VERSIONS.c.status == "serving", _VERSIONS.c.id != keep)
        .values(status="retired", retired_at=now)
    )


def serving_version(session: Session, *, model: str) -> ModelVersionView | None:
    row = session.execute(
        select(_VERSIONS).where(_VERSIONS.c.model == model, _VERSIONS.c.status == "serving")
    ).one_or_none()
    return None if row is None else ModelVersionView(**row._asdict())


def get_version(session: Session, *, version_id: str) -> ModelVersionView:
    row = session.execute(select(_VERSIONS).where(_VERSIONS.c.id == version_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no model version {version_id}")
    return ModelVersionView(**row._asdict())


def list_versions(
    session: Session, *, model: str | None = None, status: str | None = None, limit: int = 100
) -> tuple[ModelVersionView, ...]:
    """Newest first."""
    query = select(_VERSIONS).order_by(_VERSIONS.c.created_at.desc(), _VERSIONS.c.id).limit(limit)
    if model is not None:
        query = query.where(_VERSIONS.c.model == model)
    if status is not None:
        query = query.where(_VERSIONS.c.status == status)
    return tuple(ModelVersionView(**row._asdict()) for row in session.execute(query))


def _rowcount(result: Any) -> int:
    return int(result.rowcount)
