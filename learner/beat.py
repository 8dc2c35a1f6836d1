"""Beat's scheduler: the training schedules stored in the database, read again on every tick.

Every tick (at most ``learn_check_interval_s`` apart, and just after the next slot of a cron or
interval schedule) the scheduler reads the enabled schedules, works out the slot due now for each
(``learner.schedule_slots``), claims it (``storage.schedules.claim_slot``: an insert that the primary
key lets exactly one beat win) and, only when it won, sends ``tandem.learn`` with the schedule's id
and round settings. So new schedules, edits and deletions take effect at the next tick without a
restart, and any number of beat processes on one database fire each slot once. A slot is claimed
before its task is sent, so a beat that dies in between loses that firing rather than doubling it;
a task that cannot be sent gives its slot back for the next tick.

A feedback schedule needs the serving model (its feedback and watermark): beat asks the server it
learns for (``GET /admin/weights``), like a worker. While the server does not answer, feedback
schedules wait; cron and interval schedules do not need it.

On its first tick against an empty schedules table, a beat creates the ``default`` feedback schedule
from the settings (``learn_min_feedback`` ratings, at most once per ``learn_min_interval_s``), so a
fresh install learns with no configuration. Disabling that schedule stops learning; deleting every
schedule brings it back at the next beat start.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid
from datetime import datetime
from typing import Any

from celery.beat import Scheduler
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from learner.celery_app import LearnerCelery, send_learn
from learner.schedule_slots import FeedbackState, Slot, Timing, due_slot, next_fire_at
from storage import count_feedback_since, last_watermark, list_rounds, make_engine, make_session_factory
from storage.audit import record_admin_action
from storage.schedules import (
    ScheduleNameTaken,
    ScheduleView,
    claim_slot,
    count_firings,
    create_schedule,
    last_fired_at,
    list_schedules,
    release_slot,
)
from storage.times import utcnow
from tandem.settings import Settings

__all__ = ["DEFAULT_SCHEDULE", "DatabaseScheduler", "ensure_default_schedule"]

log = logging.getLogger(__name__)

DEFAULT_SCHEDULE = "default"
WAKE_AFTER_SLOT_S = 0.01  # wake just after a slot's time, so that it is the latest slot at or before now
MIN_WAIT_S = 0.01
SERVER_TIMEOUT_S = 10.0


class DatabaseScheduler(Scheduler):  # type: ignore[misc]
    """Celery beat's scheduler for ``tandem.learn``: the schedules table instead of ``beat_schedule``.

    Celery's own periodic entries (the result store's daily cleanup) still run beside it.
    """

    def __init__(self, app: LearnerCelery, *args: Any, **kwargs: Any) -> None:
        self.beat_id = f"{socket.gethostname()}:{os.getpid()}"
        self._db: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._seeded = False
        self._server_down = False
        super().__init__(app, *args, **kwargs)

    @property
    def settings(self) -> Settings:
        return self.app.tandem_settings  # type: ignore[no-any-return]

    def setup_schedule(self) -> None:
        self.install_default_entries(self.data)  # no beat_schedule: the schedules live in the database

    def tick(self, *args: Any, **kwargs: Any) -> float:
        celery_wait = float(super().tick(*args, **kwargs))
        try:
            wait = self.fire_due(utcnow())
        except Exception:  # a database or broker outage must not end beat: the next tick tries again
            log.warning("schedules: this tick failed; retrying at the next", exc_info=True)
            wait = self.settings.learner.check_interval_s
        return min(celery_wait, wait)

    def fire_due(self, now: datetime) -> float:
        """Fire the slot due now of every enabled schedule; returns the seconds until the next tick."""
        sessions = self._session_factory()
        if not self._seeded:
            with sessions.begin() as session:
                ensure_default_schedule(session, self.settings, actor=f"beat:{self.beat_id}")
            self._seeded = True
        with sessions() as session:
            schedules = list_schedules(session, enabled=True)
        feedback = self._feedback_states([s for s in schedules if s.kind == "feedback"])
        wait = self.settings.learner.check_interval_s
        for schedule in schedules:
            timing = Timing.of(schedule)
            if schedule.kind == "feedback" and schedule.id not in feedback:
                continue  # the server did not say what it serves
            slot = due_slot(timing, now, feedback.get(schedule.id))
            if slot is not None:
                self._fire(sessions, schedule, slot, now)
            following = next_fire_at(timing, now)
            if following is not None:
                wait = min(wait, (following - now).total_seconds() + WAKE_AFTER_SLOT_S)
        return max(wait, MIN_WAIT_S)

    def _fire(self, sessions: sessionmaker[Session], schedule: ScheduleView, slot: Slot, now: datetime) -> None:
        task_id = str(uuid.uuid4())
        fields = {"schedule_id": schedule.id, "schedule": schedule.name, "slot": slot.key, "task_id": task_id}
        with sessions.begin() as session:
            won = claim_slot(
                session, schedule_id=schedule.id, slot=slot.key, beat=self.beat_id, task_id=task_id, now=now
            )
        if not won:
            log.debug("schedule slot fired by another beat", extra=fields)
            return
        try:
            send_learn(
                self.app,
                task_id=task_id,
                trigger="schedule",
                schedule_id=schedule.id,
                round_settings=schedule.round_settings,
                expires=slot.expires_at,
                producer=self.producer,
            )
        except Exception:
            with sessions.begin() as session:
                release_slot(session, schedule_id=schedule.id, slot=slot.key)
            raise
        log.info("schedule fired", extra={**fields, "beat": self.beat_id})

    def _feedback_states(self, schedules: list[ScheduleView]) -> dict[str, FeedbackState]:
        """Each feedback schedule's view of the serving model's feedback; empty while the server is down."""
        if not schedules:
            return {}
        model = self._serving_model()
        if model is None:
            return {}
        with self._session_factory()() as session:
            watermark = last_watermark(session, model=model)
            new = count_feedback_since(session, model=model, since=watermark)
            active = any(list_rounds(session, model=model, status=status, limit=1) for status in ("queued", "running"))
            fired = last_fired_at(session, [s.id for s in schedules])
            return {
                s.id: FeedbackState(
                    watermark=watermark,
                    new_feedback=new,
                    round_active=active,
                    firings_at_watermark=count_firings(session, schedule_id=s.id, slot_prefix=f"feedback:{watermark}:"),
                    last_fired_at=fired.get(s.id),
                )
                for s in schedules
            }

    def _serving_model(self) -> str | None:
        # Imported here: the round's modules load torch, which a beat without feedback schedules never needs.
        from learner.round_config import RoundError
        from learner.server_api import ServerApi

        key = self.settings.server.admin_key or self.settings.server.internal_admin_key
        server = self.app.server_url or self.settings.local_server_url
        try:
            if key is None:
                raise RoundError("no admin key to ask the server what it serves (TANDEM_ADMIN_KEY)")
            model = str(ServerApi(server, key.get_secret_value(), SERVER_TIMEOUT_S).serving()["model"])
        except RoundError as exc:
            if not self._server_down:  # once per outage, not every tick
                log.warning("schedules: feedback schedules wait for the server", extra={"reason": str(exc)})
            self._server_down = True
            return None
        if self._server_down:
            log.info("schedules: the server answers again", extra={"server": server})
        self._server_down = False
        return model

    def _session_factory(self) -> sessionmaker[Session]:
        if self._sessions is None:  # in beat's own process: an engine must not cross a fork
            self._db = make_engine(self.settings.resolved_database_url)
            self._sessions = make_session_factory(self._db)
        return self._sessions

    def close(self) -> None:
        super().close()
        if self._db is not None:
            self._db.dispose()
            self._db = self._sessions = None

    @property
    def info(self) -> str:
        return (
            f"    . schedules -> {make_url(self.settings.resolved_database_url).render_as_string(hide_password=True)}"
        )


def ensure_default_schedule(session: Session, settings: Settings, *, actor: str) -> ScheduleView | None:
    """Create the ``default`` feedback schedule from ``settings`` when there is no schedule at all.

    Returns it when this call created it (audited as ``schedule.create`` by ``actor``); None when a
    schedule exists, or another beat created the default first.
    """
    if list_schedules(session, limit=1):
        return None
    fields: dict[str, Any] = {
        "name": DEFAULT_SCHEDULE,
        "kind": "feedback",
        "cron": None,
        "interval_s": math.ceil(settings.learner.min_interval_s) or None,
        "min_feedback": settings.learner.min_feedback,
        "quiet_start": None,
        "quiet_end": None,
        "timezone": "UTC",
        "round_settings": {},
        "enabled": True,
    }
    try:
        created = create_schedule(session, fields)
    except ScheduleNameTaken:
        return None
    details = {
        "name": DEFAULT_SCHEDULE,
        "reason": "no schedules: the default from learn_min_feedback and learn_min_interval_s",
    }
    record_admin_action(
        session, actor=actor, action="schedule.create", target=created.id, details=details, status_code=201
    )
    extra = {"schedule_id": created.id, "min_feedback": created.min_feedback, "interval_s": created.interval_s}
    log.info("schedules: created the default schedule", extra=extra)
    return created
