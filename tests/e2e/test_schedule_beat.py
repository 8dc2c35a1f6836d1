"""Two real `tandem beat` processes on one database (SQLite, then PostgreSQL) and one Redis queue.

An interval schedule fires every second, then, edited while the beats run, every two seconds; the
beats are stopped for several intervals and started again; at last the schedule is disabled. The
learn tasks really sent (the messages in the Redis queue: no worker consumes them) are counted
against the firing rows: every slot is sent exactly once, whichever beat claims it, the edit and the
disabling change the firing without a restart, and after the outage one firing, not a backlog.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from learner.celery_app import LEARN
from storage.db import make_engine, make_session_factory
from storage.schedules import FiringView, ScheduleView, create_schedule, list_firings, update_schedule
from tests.support.learner_queue import REDIS, SentTask, redis_prefix, sent_tasks
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

ROUND_SETTINGS = {"learning_rate": 1e-5}
DOWNTIME_S = 7.0  # longer than three two-second slots: at least three slots pass with no beat running
LOST_CLAIM = "schedule slot fired by another beat"
WAKING_UP = "beat: Waking up"


class Beat:
    """A `tandem beat` process; its log is kept for the test to read."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "beat", "--server", "http://127.0.0.1:9"],
                env={**os.environ, **env},
                stdout=out,
                stderr=out,
            )

    def ticking(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"beat exited with {self.popen.returncode}: {self.log.read_text()[-3000:]}")
        return "beat: Starting..." in self.log.read_text()

    def ticks(self) -> int:
        """Ticks ended so far: after each, beat logs when it wakes up next (at DEBUG)."""
        return self.log.read_text().count(WAKING_UP)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(timeout=30)


def start_beats(env: dict[str, str], logs: Path, run: int) -> list[Beat]:
    beats = [Beat(env, logs / f"beat-{run}-{i}.log") for i in range(2)]
    try:
        wait_until(lambda: all(beat.ticking() for beat in beats), timeout_s=60, what="both beats tick")
    except BaseException:
        stop(beats)
        raise
    return beats


def tick_after(beats: list[Beat], moment: float) -> None:
    """Return once every beat has run a whole tick begun after ``moment`` (a ``time.time()``)."""
    time.sleep(max(0.0, moment - time.time()))  # a slot is a moment of the clock: nothing shows it earlier
    ended = [beat.ticks() for beat in beats]
    # A tick logs as it ends, so of two ticks ending from now on, the second began after now.
    wait_until(
        lambda: all(beat.ticks() >= n + 2 for beat, n in zip(beats, ended, strict=True)),
        timeout_s=30,
        what="every beat ticks twice more",
    )


def stop(beats: list[Beat]) -> None:
    for beat in beats:  # all at once: each takes a few seconds to shut down
        if beat.popen.poll() is None:
            beat.popen.terminate()
    for beat in beats:
        beat.stop()


def epoch(slot: str) -> float:
    return datetime.fromisoformat(slot.replace("Z", "+00:00")).timestamp()


def test_two_beats_send_every_slot_once_follow_edits_and_do_not_catch_up(database_url: str, tmp_path: Path) -> None:
    db = make_engine(database_url)
    sessions = make_session_factory(db)
    with sessions.begin() as session:
        schedule = create_schedule(
            session,
            {
                "name": f"every-second-{tmp_path.name}",
                "kind": "interval",
                "cron": None,
                "interval_s": 1,
                "min_feedback": None,
                "quiet_start": None,
                "quiet_end": None,
                "timezone": "UTC",
                "round_settings": ROUND_SETTINGS,
                "enabled": True,
            },
        )
    try:
        with redis_prefix() as prefix:
            env = {
                "TANDEM_DATA_DIR": str(tmp_path),
                "TANDEM_DATABASE_URL": database_url,
                "TANDEM_ADMIN_KEY": "unused-by-interval-schedules",
                "TANDEM_REDIS_URL": REDIS,
                "TANDEM_REDIS_KEY_PREFIX": prefix,
                "TANDEM_LEARN_CHECK_INTERVAL_S": "1",
                "TANDEM_LOG_LEVEL": "DEBUG",  # lost claims are logged at DEBUG
                "TANDEM_LOG_FORMAT": "console",
            }
            _run_and_check(sessions, schedule, env, prefix, tmp_path)
    finally:
        db.dispose()


def _run_and_check(
    sessions: sessionmaker[Session], schedule: ScheduleView, env: dict[str, str], prefix: str, logs: Path
) -> None:
    beats = start_beats(env, logs, 0)
    try:
        _wait_for_firings(sessions, schedule.id, 2, after=0.0)  # starting beats on a loaded machine: no fixed sleep
        with sessions.begin() as session:  # an edit while both beats run
            edited = update_schedule(session, schedule.id, {"interval_s": 2})
        _wait_for_firings(sessions, schedule.id, 1, after=edited.updated_at.timestamp())
        # Both beats compete for the slots: run until one has lost a claim (checked below).
        wait_until(lambda: _lost_claims(logs) >= 1, timeout_s=60, what="a beat loses a claim", interval_s=0.1)
    finally:
        stop(beats)
    with sessions() as session:
        before_outage = list_firings(session, schedule_id=schedule.id)
    time.sleep(DOWNTIME_S)
    restarted = time.time()
    beats = start_beats(env, logs, 1)
    try:
        _wait_for_firings(sessions, schedule.id, 1, after=restarted)
        with sessions.begin() as session:
            disabled = update_schedule(session, schedule.id, {"enabled": False})
        # Every beat has ticked past the next two-second slot, which must not fire.
        tick_after(beats, (math.floor(disabled.updated_at.timestamp() / 2) + 1) * 2)
    finally:
        stop(beats)

    with sessions() as session:
        firings = list_firings(session, schedule_id=schedule.id)
    sent = [task for task in sent_tasks(prefix) if task.kwargs.get("schedule_id") == schedule.id]
    _every_slot_sent_once(schedule.id, firings, sent)

    at_one_second = [f for f in before_outage if f.fired_at < edited.updated_at]
    at_two_seconds = [f for f in before_outage if f.fired_at >= edited.updated_at]
    assert len(at_one_second) >= 2 and len(at_two_seconds) >= 1, [f.slot for f in before_outage]
    # The edit took effect without a restart: every later slot is on the two-second grid, after it.
    assert all(epoch(f.slot) % 2 == 0 and epoch(f.slot) >= edited.updated_at.timestamp() for f in at_two_seconds)
    # Each firing is its latest slot (fired before the next one came): none is a backlog's.
    for firing in firings:
        interval = 1 if firing in at_one_second else 2
        assert 0 <= firing.fired_at.timestamp() - epoch(firing.slot) < interval, firing

    # After the outage: several slots passed unfired, and the restarted beats fired only the latest
    # (each firing above is its latest slot), not the backlog.
    after = [f for f in firings if f.fired_at.timestamp() > restarted]
    assert after and len(firings) == len(before_outage) + len(after), [f.slot for f in firings]
    unfired = range(int(max(epoch(f.slot) for f in before_outage)) + 2, int(min(epoch(f.slot) for f in after)), 2)
    assert len(unfired) >= 2, [f.slot for f in firings]
    # Disabled while the beats run: nothing fires after it.
    assert all(f.fired_at < disabled.updated_at for f in firings)

    # Both beats competed for the slots: the loser of a claim says so and sends nothing.
    assert _lost_claims(logs) >= 1


def _lost_claims(logs: Path) -> int:
    return sum(log.read_text().count(LOST_CLAIM) for log in logs.glob("beat-*.log"))


def _wait_for_firings(sessions: sessionmaker[Session], schedule_id: str, count: int, *, after: float) -> None:
    def fired() -> bool:
        with sessions() as session:
            firings = list_firings(session, schedule_id=schedule_id)
        return sum(f.fired_at.timestamp() > after for f in firings) >= count

    wait_until(fired, timeout_s=60, what=f"{count} firing(s) after {after}", interval_s=0.1)


def _every_slot_sent_once(schedule_id: str, firings: tuple[FiringView, ...], sent: list[SentTask]) -> None:
    sent_ids = [task.task_id for task in sent]
    assert len(sent_ids) == len(set(sent_ids)), "a task was sent twice"
    assert sorted(sent_ids) == sorted(f.task_id or "" for f in firings), "sent tasks and claimed slots differ"
    assert len({f.slot for f in firings}) == len(firings)
    for task in sent:
        assert task.task == LEARN and task.expires is not None
        assert task.kwargs == {"schedule_id": schedule_id, "round_settings": ROUND_SETTINGS, "trigger": "schedule"}
