"""/admin/schedules: training schedules (create, list, show, edit, delete, enable, disable, run now).

A schedule says when rounds fire (a cron expression, a fixed interval, or after N new ratings; quiet
hours skip slots) and with which round settings. Beat reads the table on every tick, so a change
takes effect without a restart (``learner.beat``). Timings are checked by ``learner.schedule_slots``,
round settings by ``learner.round_overrides`` against this gateway's settings, both with the field
to fix as ``param``. Every action commits with its audit entry; refusals are audited with their
status.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from kombu.exceptions import OperationalError
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session, sessionmaker

from admin.audited import audited, read
from admin.deps import ActorDep, SessionsDep, in_thread
from admin.routes.pages import Limit, page
from admin.schemas import DeletedSchedule, Schedule, SchedulePage, ScheduleRun
from learner.celery_app import LearnerCelery, send_learn
from learner.round_overrides import RoundSettingsError, check_round_settings
from learner.schedule_slots import (
    KIND_FIELDS,
    TIMING_FIELDS,
    USED_BY,
    ScheduleKind,
    Timing,
    TimingError,
    check_timing,
    next_fire_at,
)
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.learning_errors import NotFoundError
from storage.schedules import (
    SCHEDULE_FIELDS,
    ScheduleNameTaken,
    ScheduleView,
    claim_slot,
    create_schedule,
    delete_schedule,
    get_schedule,
    last_fired_at,
    list_schedules,
    update_schedule,
)
from storage.times import utcnow

router = APIRouter()

MAX_INT32 = 2**31 - 1  # the columns' integer range on PostgreSQL
NOT_NULL = ("name", "kind", "timezone", "round_settings", "enabled")


class UpdateSchedule(BaseModel):
    """A change: only the fields given change (null clears an optional one)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    kind: ScheduleKind | None = None
    cron: str | None = Field(None, max_length=120, description="kind cron: '0 3 * * *' (5 fields) or '@hourly'.")
    interval_s: int | None = Field(
        None, le=MAX_INT32, description="kind interval: seconds; kind feedback: the least gap."
    )
    min_feedback: int | None = Field(None, le=MAX_INT32, description="kind feedback: new ratings that make it due.")
    quiet_start: str | None = Field(None, max_length=5, description="HH:MM in timezone; no slot fires until quiet_end.")
    quiet_end: str | None = Field(None, max_length=5)
    timezone: str | None = Field(None, min_length=1, max_length=64, description="IANA name, for cron and quiet hours.")
    round_settings: dict[str, Any] | None = Field(
        None, description="learn_* settings (without the prefix) to override."
    )
    enabled: bool | None = None


class CreateSchedule(UpdateSchedule):
    name: str = Field(min_length=1, max_length=200)
    kind: ScheduleKind
    timezone: str = Field("UTC", min_length=1, max_length=64)
    round_settings: dict[str, Any] = Field(default_factory=dict)
    enabled: bool = True


def schedule_view(schedule: ScheduleView, fired_at: datetime | None, now: datetime) -> dict[str, Any]:
    following = next_fire_at(Timing.of(schedule), now) if schedule.enabled else None
    return {
        "id": schedule.id,
        **{name: getattr(schedule, name) for name in SCHEDULE_FIELDS},
        "created_at": schedule.created_at.isoformat(),
        "updated_at": schedule.updated_at.isoformat(),
        "next_fire_at": following.isoformat() if following else None,
        "last_fired_at": fired_at.isoformat() if fired_at else None,
        "paused_reason": schedule.paused_reason,
        "paused_at": schedule.paused_at.isoformat() if schedule.paused_at else None,
    }


def _shown(session: Session, schedule: ScheduleView) -> dict[str, Any]:
    return schedule_view(schedule, last_fired_at(session, [schedule.id]).get(schedule.id), utcnow())


def _get(session: Session, schedule_id: str) -> ScheduleView:
    try:
        return get_schedule(session, schedule_id)
    except NotFoundError as exc:
        raise ApiError(
            404, f"No schedule with id '{schedule_id}'.", param="schedule_id", code="schedule_not_found"
        ) from exc


def _checked(learner: LearnerCelery, fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (every schedule field) validated, with the round settings as they will be stored."""
    for name in NOT_NULL:
        if fields[name] is None:
            raise ApiError(400, f"{name} cannot be null.", param=name, code="invalid_schedule")
    timing = Timing(**{name: fields[name] for name in TIMING_FIELDS})
    try:
        check_timing(timing, now=utcnow())
    except TimingError as exc:
        raise ApiError(400, exc.message, param=exc.param, code="invalid_schedule") from exc
    try:
        round_settings = check_round_settings(learner.tandem_settings, fields["round_settings"])
    except RoundSettingsError as exc:
        raise ApiError(400, exc.message, param=exc.param, code="invalid_round_settings") from exc
    return {**fields, "round_settings": round_settings}


def _name_taken(name: str) -> ApiError:
    return ApiError(409, f"Another schedule is named '{name}'.", param="name", code="schedule_exists")


@router.post("/admin/schedules", status_code=201, response_model=Schedule, responses={**ERRORS, **CONFLICT})
async def create(body: CreateSchedule, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    schedule_id = f"sched_{uuid.uuid4().hex[:16]}"
    fields = body.model_dump(include=set(SCHEDULE_FIELDS))

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        checked = _checked(request.app.state.learner, fields)
        try:
            created = create_schedule(session, checked, schedule_id=schedule_id)
        except ScheduleNameTaken as exc:
            raise _name_taken(body.name) from exc
        return schedule_view(created, None, utcnow()), {"name": body.name, "fields": checked}

    view = await audited(sessions, work, actor=actor, action="schedule.create", target=schedule_id, status_code=201)
    return json_response(view, 201)


@router.get("/admin/schedules", response_model=SchedulePage, responses=ERRORS)
async def list_all(
    _: AdminDep,
    sessions: SessionsDep,
    before: Annotated[str | None, Query(max_length=64, description="next_before of the previous page.")] = None,
    limit: Limit = 50,
) -> Response:
    def work(session: Session) -> list[dict[str, Any]]:
        try:
            rows = list_schedules(session, before=before, limit=limit + 1)
        except NotFoundError as exc:
            raise ApiError(
                400, f"{exc}: pass next_before from a previous page.", param="before", code="invalid_cursor"
            ) from exc
        fired, now = last_fired_at(session, [row.id for row in rows]), utcnow()
        return [schedule_view(row, fired.get(row.id), now) for row in rows]

    return json_response(page(await in_thread(read, sessions, work), limit, lambda schedule: schedule["id"]))


@router.get("/admin/schedules/{schedule_id}", response_model=Schedule, responses=ERRORS)
async def show(schedule_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    return json_response(await in_thread(read, sessions, lambda session: _shown(session, _get(session, schedule_id))))


@router.patch("/admin/schedules/{schedule_id}", response_model=Schedule, responses={**ERRORS, **CONFLICT})
async def edit(
    schedule_id: str, body: UpdateSchedule, actor: ActorDep, sessions: SessionsDep, request: Request
) -> Response:
    """Change the fields given. Changing ``kind`` clears the fields the new kind does not use."""
    changes = body.model_dump(exclude_unset=True)

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        current = _get(session, schedule_id)
        if "kind" in changes:
            for name in KIND_FIELDS:
                if name not in changes and name not in USED_BY.get(changes["kind"] or "", ()):
                    changes[name] = None
        merged = {name: getattr(current, name) for name in SCHEDULE_FIELDS} | changes
        checked = _checked(request.app.state.learner, merged)
        try:
            changed = update_schedule(session, schedule_id, {name: checked[name] for name in changes})
        except ScheduleNameTaken as exc:
            raise _name_taken(str(changes.get("name"))) from exc
        return _shown(session, changed), {"changes": {name: checked[name] for name in changes}}

    return json_response(await audited(sessions, work, actor=actor, action="schedule.update", target=schedule_id))


@router.delete("/admin/schedules/{schedule_id}", response_model=DeletedSchedule, responses=ERRORS)
async def delete(schedule_id: str, actor: ActorDep, sessions: SessionsDep) -> Response:
    """Delete a schedule and its firing history; rounds it fired keep its id. Answers it as it was."""

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        shown = _shown(session, _get(session, schedule_id))
        delete_schedule(session, schedule_id)
        return shown | {"next_fire_at": None, "deleted": True}, {"name": shown["name"]}

    return json_response(await audited(sessions, work, actor=actor, action="schedule.delete", target=schedule_id))


@router.post("/admin/schedules/{schedule_id}/enable", response_model=Schedule, responses=ERRORS)
async def enable(schedule_id: str, actor: ActorDep, sessions: SessionsDep) -> Response:
    """Fire again from the next slot on (a slot that passed while disabled does not fire); a schedule the
    drift guard paused resumes, and its ``paused_reason`` is cleared."""
    return json_response(await _set_enabled(sessions, schedule_id, True, actor))


@router.post("/admin/schedules/{schedule_id}/disable", response_model=Schedule, responses=ERRORS)
async def disable(schedule_id: str, actor: ActorDep, sessions: SessionsDep) -> Response:
    """Fire no more until enabled; a round already sent still runs."""
    return json_response(await _set_enabled(sessions, schedule_id, False, actor))


async def _set_enabled(sessions: sessionmaker[Session], schedule_id: str, enabled: bool, actor: str) -> dict[str, Any]:
    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        before = _get(session, schedule_id).enabled
        return _shown(session, update_schedule(session, schedule_id, {"enabled": enabled})), {"was_enabled": before}

    action = "schedule.enable" if enabled else "schedule.disable"
    return await audited(sessions, work, actor=actor, action=action, target=schedule_id)


@router.post("/admin/schedules/{schedule_id}/run", status_code=202, response_model=ScheduleRun, responses=ERRORS)
async def run_now(schedule_id: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Send a round now with the schedule's round settings (trigger "manual"), enabled or not.

    The firing is recorded (``last_fired_at``); the task is sent inside the transaction that records
    it, so a broker that refuses it leaves no firing and no audit entry behind (503).
    """
    learner: LearnerCelery = request.app.state.learner
    task_id = str(uuid.uuid4())

    def work(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
        schedule = _get(session, schedule_id)
        claim_slot(session, schedule_id=schedule_id, slot=f"run:{task_id}", beat=actor, task_id=task_id)
        try:
            send_learn(
                learner,
                task_id=task_id,
                trigger="manual",
                schedule_id=schedule_id,
                round_settings=schedule.round_settings,
            )
        except (OperationalError, OSError) as exc:
            raise ApiError(503, f"The learner's broker is unavailable: {exc}", code="broker_unavailable") from exc
        return {"task_id": task_id, "schedule_id": schedule_id}, {"task_id": task_id, "name": schedule.name}

    sent = await audited(sessions, work, actor=actor, action="schedule.run", target=schedule_id, status_code=202)
    return json_response(sent, 202)
