"""Training schedules and their firings.

A firing is claimed by inserting ``(schedule_id, slot)`` into ``schedule_firings``: the primary key
lets exactly one of several beat processes claim a slot, on SQLite and on PostgreSQL alike, and only
the claimant sends the round's task. Deleting a schedule deletes its firings (the foreign key
cascades); rounds keep the id of the schedule that fired them.

What the fields mean and which combinations are valid is ``learner.schedule_slots``'s business; this
module stores what it is given. All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.dialect_insert import dialect_insert
from storage.keyset import newest_first
from storage.learning_errors import NotFoundError
from storage.models import ScheduleFiring, TrainingSchedule
from storage.times import utcnow

__all__ = [
    "SCHEDULE_FIELDS",
    "FiringView",
    "ScheduleNameTaken",
    "ScheduleView",
    "claim_slot",
    "count_firings",
    "create_schedule",
    "delete_schedule",
    "get_schedule",
    "last_fired_at",
    "list_firings",
    "list_schedules",
    "pause_schedule",
    "release_slot",
    "update_schedule",
]

_SCHEDULES: Table = TrainingSchedule.__table__  # type: ignore[assignment]
_FIRINGS: Table = ScheduleFiring.__table__  # type: ignore[assignment]

# What an operator sets; the rest (id, created_at, updated_at) the repository does.
SCHEDULE_FIELDS = (
    "name",
    "kind",
    "cron",
    "interval_s",
    "min_feedback",
    "quiet_start",
    "quiet_end",
    "timezone",
    "round_settings",
    "enabled",
)


class ScheduleNameTaken(ValueError):
    """Another schedule has that name."""


@dataclass(frozen=True, slots=True)
class ScheduleView:
    id: str
    name: str
    kind: str
    cron: str | None
    interval_s: int | None
    min_feedback: int | None
    quiet_start: str | None
    quiet_end: str | None
    timezone: str
    round_settings: dict[str, Any]
    enabled: bool
    created_at: datetime
    updated_at: datetime
    paused_reason: str | None = None  # why the drift guard paused it (enabled is then false)
    paused_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class FiringView:
    schedule_id: str
    slot: str
    fired_at: datetime
    task_id: str | None
    beat: str | None


def create_schedule(
    session: Session, fields: Mapping[str, Any], *, schedule_id: str | None = None, now: datetime | None = None
) -> ScheduleView:
    """Store a schedule with ``fields`` (every name of ``SCHEDULE_FIELDS``).

    Raises:
        ScheduleNameTaken: another schedule has ``fields["name"]``.
    """
    now = now or utcnow()
    schedule_id = schedule_id or f"sched_{uuid.uuid4().hex[:16]}"
    values = {name: fields[name] for name in SCHEDULE_FIELDS}
    _write(session, _SCHEDULES.insert().values(id=schedule_id, created_at=now, updated_at=now, **values), values)
    return get_schedule(session, schedule_id)


def update_schedule(
    session: Session, schedule_id: str, changes: Mapping[str, Any], *, now: datetime | None = None
) -> ScheduleView:
    """Change some of ``SCHEDULE_FIELDS``; ``updated_at`` moves, so no slot from before the edit fires.

    Raises:
        NotFoundError: no such schedule.
        ScheduleNameTaken: another schedule has ``changes["name"]``.
    """
    unknown = set(changes) - set(SCHEDULE_FIELDS)
    if unknown:
        raise ValueError(f"not schedule fields: {sorted(unknown)}")
    get_schedule(session, schedule_id)
    resumed = {"paused_reason": None, "paused_at": None} if changes.get("enabled") is True else {}
    statement = (
        update(_SCHEDULES)
        .where(_SCHEDULES.c.id == schedule_id)
        .values(**changes, **resumed, updated_at=now or utcnow())
    )
    _write(session, statement, changes)
    return get_schedule(session, schedule_id)


def pause_schedule(session: Session, schedule_id: str, reason: str, *, now: datetime | None = None) -> ScheduleView:
    """Disable a schedule with the reason an operator reads; enabling it again is the resume.

    Raises:
        NotFoundError: no such schedule.
    """
    get_schedule(session, schedule_id)
    moment = now or utcnow()
    session.execute(
        update(_SCHEDULES)
        .where(_SCHEDULES.c.id == schedule_id)
        .values(enabled=False, paused_reason=reason, paused_at=moment, updated_at=moment)
    )
    return get_schedule(session, schedule_id)


def _write(session: Session, statement: Any, values: Mapping[str, Any]) -> None:
    try:
        with session.begin_nested():  # a savepoint: a taken name must not spoil the caller's transaction
            session.execute(statement)
    except IntegrityError as exc:
        if "name" in values and _name_taken(session, values["name"]):
            raise ScheduleNameTaken(f"another schedule is named {values['name']!r}") from exc
        raise


def _name_taken(session: Session, name: str) -> bool:
    return session.scalar(select(func.count()).where(_SCHEDULES.c.name == name)) != 0


def delete_schedule(session: Session, schedule_id: str) -> ScheduleView:
    """Delete a schedule and its firings; returns it as it was.

    Raises:
        NotFoundError: no such schedule.
    """
    gone = get_schedule(session, schedule_id)
    # Explicitly, not only by the foreign key's cascade: SQLite enforces it only with the pragma on.
    session.execute(delete(_FIRINGS).where(_FIRINGS.c.schedule_id == schedule_id))
    session.execute(delete(_SCHEDULES).where(_SCHEDULES.c.id == schedule_id))
    return gone


def get_schedule(session: Session, schedule_id: str) -> ScheduleView:
    """Raises: NotFoundError: no such schedule."""
    row = session.execute(select(_SCHEDULES).where(_SCHEDULES.c.id == schedule_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no schedule {schedule_id}")
    return ScheduleView(**row._asdict())


def list_schedules(
    session: Session, *, enabled: bool | None = None, before: str | None = None, limit: int = 1000
) -> tuple[ScheduleView, ...]:
    """Newest first, the page after schedule ``before``.

    Raises:
        NotFoundError: ``before`` is not a schedule id.
    """
    query = newest_first(select(_SCHEDULES), _SCHEDULES, session, before=before, limit=limit, what="schedule")
    if enabled is not None:
        query = query.where(_SCHEDULES.c.enabled == enabled)
    return tuple(ScheduleView(**row._asdict()) for row in session.execute(query))


def claim_slot(
    session: Session,
    *,
    schedule_id: str,
    slot: str,
    beat: str | None = None,
    task_id: str | None = None,
    now: datetime | None = None,
) -> bool:
    """Claim ``slot`` of the schedule: True for the one caller that inserted it, False for every other
    (the slot is taken, or the schedule was deleted meanwhile).

    On PostgreSQL a concurrent claim of the same slot waits for the first to commit or roll back, so
    the loser's False is final once the winner committed.
    """
    values = {"schedule_id": schedule_id, "slot": slot, "fired_at": now or utcnow(), "task_id": task_id, "beat": beat}
    # RETURNING, not rowcount: psycopg answers -1 for the count of an INSERT ... ON CONFLICT.
    statement = dialect_insert(session, ScheduleFiring).values(**values).on_conflict_do_nothing()
    try:
        with session.begin_nested():  # the foreign key of a deleted schedule fails only the savepoint
            inserted = session.execute(statement.returning(_FIRINGS.c.slot)).first()
    except IntegrityError:
        return False
    return inserted is not None


def release_slot(session: Session, *, schedule_id: str, slot: str) -> None:
    """Give a claimed slot back (its task could not be sent), so that a later tick may claim it again."""
    session.execute(delete(_FIRINGS).where(_FIRINGS.c.schedule_id == schedule_id, _FIRINGS.c.slot == slot))


def last_fired_at(session: Session, schedule_ids: Iterable[str]) -> dict[str, datetime]:
    """The latest firing of each schedule that has fired."""
    ids = list(schedule_ids)
    if not ids:
        return {}
    query = (
        select(_FIRINGS.c.schedule_id, func.max(_FIRINGS.c.fired_at))
        .where(_FIRINGS.c.schedule_id.in_(ids))
        .group_by(_FIRINGS.c.schedule_id)
    )
    return {schedule_id: at for schedule_id, at in session.execute(query)}


def count_firings(session: Session, *, schedule_id: str, slot_prefix: str) -> int:
    """How many slots starting with ``slot_prefix`` the schedule fired."""
    query = select(func.count()).where(
        _FIRINGS.c.schedule_id == schedule_id, _FIRINGS.c.slot.startswith(slot_prefix, autoescape=True)
    )
    return int(session.scalar(query) or 0)


def list_firings(session: Session, *, schedule_id: str) -> tuple[FiringView, ...]:
    """Oldest first."""
    query = select(_FIRINGS).where(_FIRINGS.c.schedule_id == schedule_id).order_by(_FIRINGS.c.fired_at, _FIRINGS.c.slot)
    return tuple(FiringView(**row._asdict()) for row in session.execute(query))
