"""learner.beat's scheduler ticked by hand at chosen times, on SQLite and PostgreSQL and a real Redis
queue: one send per slot across two schedulers, disabled schedules silent, a slot whose task could
not be sent given back, feedback schedules waiting for an unreachable server, the default schedule."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from learner.beat import DEFAULT_SCHEDULE, DatabaseScheduler, ensure_default_schedule
from learner.celery_app import create_celery_app
from migrations.migrate import upgrade
from storage.audit import list_admin_actions
from storage.db import make_engine, make_session_factory
from storage.schedules import ScheduleView, create_schedule, list_firings, update_schedule
from storage.times import from_unix, utcnow
from tandem.settings import Settings
from tests.support.learner_queue import REDIS, redis_prefix, sent_tasks


@pytest.fixture
def prefix() -> Iterator[str]:
    with redis_prefix() as prefix:
        yield prefix


def scheduler(database_url: str, tmp_path: Path, prefix: str, **overrides: Any) -> DatabaseScheduler:
    values = {
        "data_dir": tmp_path,
        "database_url": database_url,
        "admin_key": "k",
        "redis_url": REDIS,
        "redis_key_prefix": prefix,
        "learn_check_interval_s": 30.0,
        **overrides,
    }
    app = create_celery_app(Settings(**values), server_url="http://127.0.0.1:9")  # nothing listens on port 9
    app.conf.broker_connection_max_retries = 1
    return DatabaseScheduler(app=app)


def schedule(sessions: sessionmaker[Session], **fields: Any) -> ScheduleView:
    values = {
        "name": f"s-{uuid.uuid4().hex[:8]}",
        "kind": "interval",
        "cron": None,
        "interval_s": 10,
        "min_feedback": None,
        "quiet_start": None,
        "quiet_end": None,
        "timezone": "UTC",
        "round_settings": {"steps": 3},
        "enabled": True,
        **fields,
    }
    with sessions.begin() as session:
        return create_schedule(session, values)


def ours(prefix: str, schedule_id: str) -> list[str]:
    return [t.task_id for t in sent_tasks(prefix) if t.kwargs["schedule_id"] == schedule_id]


def test_each_slot_is_sent_once_whichever_scheduler_ticks(
    database_url: str, sessions: sessionmaker[Session], tmp_path: Path, prefix: str
) -> None:
    every_10_s = schedule(sessions)
    quiet = schedule(sessions, enabled=False)
    first, second = scheduler(database_url, tmp_path, prefix), scheduler(database_url, tmp_path, prefix)
    slot = from_unix((utcnow().timestamp() // 10 + 1) * 10)  # the next slot on the 10 s grid
    try:
        wait = first.fire_due(slot + timedelta(seconds=2))
        second.fire_due(slot + timedelta(seconds=2))
        first.fire_due(slot + timedelta(seconds=9))
        assert len(ours(prefix, every_10_s.id)) == 1 and ours(prefix, quiet.id) == []
        assert 0 < wait <= 8.02  # at the latest just after this schedule's next slot (other schedules may come first)
        second.fire_due(slot + timedelta(seconds=10))
        first.fire_due(slot + timedelta(seconds=35))  # two slots missed: only the latest fires
    finally:
        first.close()
        second.close()
    sent = ours(prefix, every_10_s.id)
    with sessions() as session:
        firings = list_firings(session, schedule_id=every_10_s.id)
    assert [f.task_id for f in firings] == sent and len(sent) == 3
    assert [f.slot for f in firings] == [
        (slot + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ") for s in (0, 10, 30)
    ]


def test_a_slot_whose_task_cannot_be_sent_is_given_back(
    database_url: str, sessions: sessionmaker[Session], tmp_path: Path, prefix: str
) -> None:
    every_second = schedule(sessions, interval_s=1)
    unreachable = scheduler(database_url, tmp_path, prefix, redis_url="redis://127.0.0.1:1/0")
    working = scheduler(database_url, tmp_path, prefix)
    time.sleep(1.1)  # a slot after the schedule's creation is due
    try:
        # The broker refuses: the tick survives (beat goes on) and waits the check interval.
        assert unreachable.tick() == 30.0
        with sessions() as session:
            assert list_firings(session, schedule_id=every_second.id) == ()
        working.fire_due(utcnow())
    finally:
        unreachable.close()
        working.close()
    assert len(ours(prefix, every_second.id)) == 1


def test_feedback_schedules_wait_for_the_server(
    database_url: str,
    sessions: sessionmaker[Session],
    tmp_path: Path,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    on_feedback = schedule(sessions, kind="feedback", interval_s=None, min_feedback=1)
    beat = scheduler(database_url, tmp_path, prefix)
    try:
        with caplog.at_level(logging.WARNING, logger="learner.beat"):
            for _ in range(3):
                beat.fire_due(utcnow())
    finally:
        beat.close()
    assert ours(prefix, on_feedback.id) == []
    assert [r.message for r in caplog.records].count("schedules: feedback schedules wait for the server") == 1


def test_edits_apply_at_the_next_tick(
    database_url: str, sessions: sessionmaker[Session], tmp_path: Path, prefix: str
) -> None:
    hourly = schedule(sessions, interval_s=3600)
    beat = scheduler(database_url, tmp_path, prefix)
    try:
        soon = utcnow() + timedelta(seconds=1)
        beat.fire_due(soon)
        assert ours(prefix, hourly.id) == []  # the hour's slot was before the schedule existed
        with sessions.begin() as session:
            edited = update_schedule(session, hourly.id, {"interval_s": 1, "round_settings": {"steps": 5}})
        beat.fire_due(edited.updated_at + timedelta(seconds=1))
    finally:
        beat.close()
    (task,) = [t for t in sent_tasks(prefix) if t.kwargs["schedule_id"] == hourly.id]
    assert task.kwargs["round_settings"] == {"steps": 5}


def test_the_default_schedule_is_created_once_and_only_into_an_empty_table(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_session_factory(db)
    settings = Settings(data_dir=tmp_path, learn_min_feedback=5, learn_min_interval_s=90.5)
    created: list[ScheduleView | None] = []
    start = threading.Barrier(4)

    def race(actor: str) -> None:
        start.wait()
        with sessions.begin() as session:
            created.append(ensure_default_schedule(session, settings, actor=actor))

    threads = [threading.Thread(target=race, args=(f"beat:{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        (default,) = [c for c in created if c is not None]
        assert (default.name, default.kind, default.min_feedback, default.interval_s) == (
            DEFAULT_SCHEDULE,
            "feedback",
            5,
            91,
        )
        with sessions() as session:
            (entry,) = list_admin_actions(session, action="schedule.create")
            assert entry.target == default.id and entry.actor.startswith("beat:") and entry.status_code == 201
    finally:
        db.dispose()
