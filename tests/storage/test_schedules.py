"""storage.schedules on SQLite and PostgreSQL: CRUD, and slot claims that exactly one racer wins."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from storage.db import make_engine, make_session_factory
from storage.learning_errors import NotFoundError
from storage.rounds import finish_round, get_round, start_round
from storage.schedules import (
    ScheduleNameTaken,
    claim_slot,
    count_firings,
    create_schedule,
    delete_schedule,
    get_schedule,
    last_fired_at,
    list_firings,
    list_schedules,
    pause_schedule,
    release_slot,
    update_schedule,
)

RACERS = 8


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def fields(**overrides: Any) -> dict[str, Any]:
    return {
        "name": f"every-minute-{uuid.uuid4().hex[:8]}",
        "kind": "interval",
        "cron": None,
        "interval_s": 60,
        "min_feedback": None,
        "quiet_start": None,
        "quiet_end": None,
        "timezone": "UTC",
        "round_settings": {"learning_rate": 1e-5},
        "enabled": True,
        **overrides,
    }


def test_create_update_list_delete(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    t0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
    with sessions.begin() as session:
        first = create_schedule(session, fields(), now=t0)
        second = create_schedule(session, fields(kind="cron", cron="0 3 * * *", interval_s=None), now=t0)
    assert first.created_at == first.updated_at == t0 and first.round_settings == {"learning_rate": 1e-5}
    with sessions.begin() as session:
        changed = update_schedule(session, first.id, {"enabled": False, "quiet_start": "22:00"}, now=t0 + timedelta(1))
    assert not changed.enabled and changed.quiet_start == "22:00" and changed.updated_at == t0 + timedelta(1)
    assert changed.created_at == t0 and changed.interval_s == 60

    with sessions() as session:
        ids = {s.id for s in list_schedules(session)}
        enabled = {s.id for s in list_schedules(session, enabled=True)}
        assert {first.id, second.id} <= ids and second.id in enabled and first.id not in enabled
        # Newest first on (created_at, id): equal times still page without gaps.
        ours = [s.id for s in list_schedules(session) if s.id in (first.id, second.id)]
        assert ours == sorted(ours, reverse=True)
        page = list_schedules(session, before=ours[0], limit=1000)
        assert ours[1] in {s.id for s in page} and ours[0] not in {s.id for s in page}
        with pytest.raises(NotFoundError):
            list_schedules(session, before="sched_nope")

    with sessions.begin() as session:
        assert claim_slot(session, schedule_id=first.id, slot="a")
        assert delete_schedule(session, first.id) == changed
    with sessions() as session:
        with pytest.raises(NotFoundError):
            get_schedule(session, first.id)
        assert list_firings(session, schedule_id=first.id) == ()
        with pytest.raises(NotFoundError):
            update_schedule(session, first.id, {"enabled": True})


def test_a_taken_name_is_refused_without_spoiling_the_transaction(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    with sessions.begin() as session:
        taken = create_schedule(session, fields())
        other = create_schedule(session, fields())
    with sessions.begin() as session:
        with pytest.raises(ScheduleNameTaken):
            create_schedule(session, fields(name=taken.name))
        with pytest.raises(ScheduleNameTaken):
            update_schedule(session, other.id, {"name": taken.name})
        update_schedule(session, other.id, {"interval_s": 5})  # the transaction goes on
    with sessions() as session:
        assert get_schedule(session, other.id).interval_s == 5


def test_exactly_one_of_many_racers_claims_a_slot(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    with sessions.begin() as session:
        schedule = create_schedule(session, fields())
    start = threading.Barrier(RACERS)
    won: list[str] = []

    def race(beat: str) -> None:
        start.wait()
        with sessions.begin() as session:
            if claim_slot(session, schedule_id=schedule.id, slot="2026-12-03T08:00:00Z", beat=beat, task_id=beat):
                won.append(beat)

    threads = [threading.Thread(target=race, args=(f"beat-{i}",)) for i in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(won) == 1
    with sessions() as session:
        (firing,) = list_firings(session, schedule_id=schedule.id)
    assert firing.beat == firing.task_id == won[0] and firing.slot == "2026-12-03T08:00:00Z"


def test_claims_released_counted_and_the_last_firing(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    t0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
    with sessions.begin() as session:
        schedule = create_schedule(session, fields(kind="feedback", interval_s=None, min_feedback=3))
        idle = create_schedule(session, fields())
    with sessions.begin() as session:
        assert claim_slot(session, schedule_id=schedule.id, slot="feedback:12:0", now=t0)
        assert not claim_slot(session, schedule_id=schedule.id, slot="feedback:12:0", now=t0)
        assert claim_slot(session, schedule_id=schedule.id, slot="feedback:12:1", now=t0 + timedelta(minutes=1))
        assert claim_slot(session, schedule_id=schedule.id, slot="feedback:123:0", now=t0 + timedelta(minutes=2))
        assert not claim_slot(session, schedule_id="sched_deleted", slot="x")  # no such schedule: not an error
    with sessions() as session:
        assert count_firings(session, schedule_id=schedule.id, slot_prefix="feedback:12:") == 2
        assert count_firings(session, schedule_id=schedule.id, slot_prefix="feedback:1") == 3
        fired = last_fired_at(session, [schedule.id, idle.id])
        assert fired == {schedule.id: t0 + timedelta(minutes=2)} and fired[schedule.id].tzinfo is not None
    with sessions.begin() as session:
        release_slot(session, schedule_id=schedule.id, slot="feedback:123:0")
        assert claim_slot(session, schedule_id=schedule.id, slot="feedback:123:0", now=t0 + timedelta(minutes=3))
    with sessions() as session:
        assert last_fired_at(session, [schedule.id])[schedule.id] == t0 + timedelta(minutes=3)


def test_a_round_names_the_schedule_that_fired_it_and_outlives_it(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    with sessions.begin() as session:
        schedule = create_schedule(session, fields())
        started = start_round(
            session, model=f"m-{uuid.uuid4().hex[:8]}", worker_id="w", trigger="schedule", schedule_id=schedule.id
        )
        delete_schedule(session, schedule.id)
        # Not left running: other tests of the shared PostgreSQL database fail stale rounds of every model.
        finish_round(session, round_id=started.id, status="failed", error="test")
    with sessions() as session:
        assert get_round(session, round_id=started.id).schedule_id == schedule.id


def test_a_paused_schedule_says_why_until_it_is_enabled_again(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    at = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
    with sessions.begin() as session:
        created = create_schedule(session, fields())
        paused = pause_schedule(session, created.id, "round r1: drift guard: KL 2.1 > 1", now=at)
    assert (paused.enabled, paused.paused_reason, paused.paused_at) == (False, "round r1: drift guard: KL 2.1 > 1", at)
    with sessions.begin() as session:
        assert get_schedule(session, created.id).paused_reason is not None  # survives a reread
        update_schedule(session, created.id, {"name": "renamed"})  # other edits keep the pause
        assert get_schedule(session, created.id).paused_reason is not None
        resumed = update_schedule(session, created.id, {"enabled": True})
    assert (resumed.enabled, resumed.paused_reason, resumed.paused_at) == (True, None, None)
    with sessions.begin() as session, pytest.raises(NotFoundError):
        pause_schedule(session, "no-such-schedule", "why")
