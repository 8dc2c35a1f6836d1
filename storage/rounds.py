"""Training rounds: one at a time per model, idempotent, recovered when a worker dies.

Rounds are idempotent because the watermark only moves when a round *consumes* its data
(``finish_round(status="succeeded" or "nothing_to_learn", watermark_to=...)``): a failed or abandoned round leaves it where
it was, and the re-run collects the same data again. One round runs per model at a time: a unique
partial index on ``training_rounds(model) WHERE status = 'running'`` is the lock, released when the
round finishes or when ``fail_stale_rounds`` marks a round whose worker stopped heart-beating failed.
A failed round cannot succeed later, so a zombie worker cannot move the watermark under a re-run.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Table, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.learning_errors import LearningStateError, NotFoundError, RoundBusyError
from storage.models import TrainingRound
from storage.times import utcnow

RoundTrigger = Literal["schedule", "manual"]
RoundOutcome = Literal["succeeded", "nothing_to_learn", "failed"]
CONSUMED: tuple[RoundOutcome, ...] = ("succeeded", "nothing_to_learn")  # outcomes that move the watermark

_ROUNDS: Table = TrainingRound.__table__  # type: ignore[assignment]


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
    schedule_id: str | None = None  # the schedule that fired it (migration 0004), if any
    reason: str | None = None  # why it had nothing to learn (migration 0010)


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
    schedule_id: str | None = None,
    now: datetime | None = None,
) -> TrainingRoundView:
    """Mark a round running on ``worker_id``, from the last consumed round's watermark.

    Claims the queued round ``round_id`` when given (and it exists), else creates a new one (fired by
    the schedule ``schedule_id``, if any).

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
                session.execute(_ROUNDS.insert().values(**values, **running, schedule_id=schedule_id, created_at=now))
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
    reason: str | None = None,
    samples_collected: int | None = None,
    samples_trained: int | None = None,
    produced_version_id: str | None = None,
    now: datetime | None = None,
) -> TrainingRoundView:
    """End a running round; a consumed one (succeeded, nothing_to_learn) moves the model's watermark to
    ``watermark_to``; a ``nothing_to_learn`` one says why in ``reason``.

    Raises:
        ValueError: a consumed round without ``watermark_to``, or nothing to learn without a reason.
        LearningStateError: the round is not running (finished, cancelled, or declared dead).
    """
    if status in CONSUMED and watermark_to is None:
        raise ValueError(f"a {status} round needs the watermark it consumed up to")
    if status == "nothing_to_learn" and not reason:
        raise ValueError("a round with nothing to learn needs the reason")
    values: dict[str, Any] = {"status": status, "finished_at": now or utcnow(), "error": error, "reason": reason}
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
    """The watermark of the model's consumed rounds (0 before the first)."""
    query = select(func.max(_ROUNDS.c.watermark_to)).where(_ROUNDS.c.model == model, _ROUNDS.c.status.in_(CONSUMED))
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


def _rowcount(result: Any) -> int:
    return int(result.rowcount)
