"""The learner pool's Celery tasks: ``tandem.learn`` (a round now) and ``tandem.learn_if_due`` (beat's check).

Both run against the server of the worker that executes them (``tandem worker --server``), with the
worker's settings, and return a JSON-able summary (``status`` first):

- ``succeeded`` / ``nothing_to_learn`` / ``failed``: a round ran (round id, version, samples,
  watermarks, seconds per stage, error);
- ``busy``: another round of the model runs on a live worker (not an error: rounds are serialised);
- ``not_due`` (``learn_if_due`` only): too little new feedback, or too soon after the last round;
- ``server_unavailable`` (``learn_if_due`` only): the server did not answer; the next check retries.

A server that cannot be reached fails a ``learn`` task (RoundError).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import httpx
from celery import Task, shared_task
from sqlalchemy.orm import Session, sessionmaker

from learner.celery_app import LEARN, LEARN_IF_DUE, LearnerCelery
from learner.round import RoundError, RoundResult, run_round
from learner.round_settings import round_config
from storage import (
    RoundBusyError,
    TrainingRoundView,
    count_feedback_since,
    fail_stale_rounds,
    last_watermark,
    list_rounds,
    make_engine,
    make_session_factory,
)
from storage.times import utcnow
from tandem.settings import Settings

__all__ = ["learn", "learn_if_due", "learn_if_due_now", "learn_now"]

log = logging.getLogger(__name__)

Trigger = Literal["manual", "schedule"]


@shared_task(bind=True, name=LEARN)
def learn(self: Task) -> dict[str, Any]:
    """Run one round now (trigger "manual")."""
    settings, server_url, admin_key = _worker_context(self)
    return learn_now(settings, server_url=server_url, admin_key=admin_key)


@shared_task(bind=True, name=LEARN_IF_DUE)
def learn_if_due(self: Task) -> dict[str, Any]:
    """Run a scheduled round when enough new feedback arrived and the last round is old enough."""
    settings, server_url, admin_key = _worker_context(self)
    return learn_if_due_now(settings, server_url=server_url, admin_key=admin_key)


def learn_now(settings: Settings, *, server_url: str, admin_key: str) -> dict[str, Any]:
    """One manual round; when the model's lock is held, wait to see whether its holder is alive.

    A task redelivered because its worker died can arrive before that worker's round is stale: it
    waits for the round to go stale (then fails it and runs) or to heartbeat (then answers "busy").

    Raises:
        RoundError: the server cannot be reached or refused the admin key.
    """
    sessions, dispose = _sessions(settings)
    try:
        _fail_stale(sessions, settings)
        try:
            return _run(settings, server_url, admin_key, "manual")
        except RoundError as exc:
            if not isinstance(exc.__cause__, RoundBusyError):
                raise
            model = serving_model(server_url, admin_key)
            if not _lock_holder_died(sessions, settings, model):
                return _busy(exc)
        try:
            return _run(settings, server_url, admin_key, "manual")
        except RoundError as exc:
            if isinstance(exc.__cause__, RoundBusyError):  # another worker took the freed lock first
                return _busy(exc)
            raise
    finally:
        dispose()


def learn_if_due_now(settings: Settings, *, server_url: str, admin_key: str) -> dict[str, Any]:
    """Beat's check: a round (trigger "schedule") when ``learn_min_feedback`` new rated answers arrived
    since the model's watermark and ``learn_min_interval_s`` passed since the last round started.

    A server that cannot be reached (restarting, say) is logged and answered ``server_unavailable``:
    the next check tries again.
    """
    try:
        model = serving_model(server_url, admin_key)
    except RoundError as exc:
        log.warning("learn_if_due: the server is unavailable", extra={"server": server_url, "reason": str(exc)})
        return {"status": "server_unavailable", "error": str(exc)}
    sessions, dispose = _sessions(settings)
    try:
        _fail_stale(sessions, settings)
        with sessions() as session:
            new = count_feedback_since(session, model=model, since=last_watermark(session, model=model))
            latest = list_rounds(session, model=model, limit=1)
    finally:
        dispose()
    reason = _not_due_reason(settings, new, latest[0] if latest else None)
    if reason is not None:
        log.debug("learn_if_due: not due", extra={"model": model, "new_feedback": new, "reason": reason})
        return {"status": "not_due", "model": model, "new_feedback": new, "reason": reason}
    try:
        return _run(settings, server_url, admin_key, "schedule")
    except RoundError as exc:
        if isinstance(exc.__cause__, RoundBusyError):
            return _busy(exc)
        raise


def _not_due_reason(settings: Settings, new_feedback: int, latest: TrainingRoundView | None) -> str | None:
    if new_feedback < settings.learn_min_feedback:
        return f"{new_feedback} of {settings.learn_min_feedback} rated answers"
    if latest is None:
        return None
    if latest.status in ("queued", "running"):
        return f"round {latest.id} is {latest.status}"
    elapsed = (utcnow() - (latest.started_at or latest.created_at)).total_seconds()
    if elapsed < settings.learn_min_interval_s:
        return f"the last round started {elapsed:.0f} s ago"
    return None


def serving_model(server_url: str, admin_key: str, timeout_s: float = 30.0) -> str:
    """The model the server serves (``GET /admin/weights``).

    Raises:
        RoundError: the server cannot be reached or did not answer 200.
    """
    url = f"{server_url.rstrip('/')}/admin/weights"
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RoundError(f"cannot reach the server at {server_url}: {exc}") from exc
    if response.status_code != 200:
        raise RoundError(f"GET /admin/weights answered {response.status_code}: {response.text[:500]}")
    return str(response.json()["model"])


def summary(result: RoundResult) -> dict[str, Any]:
    """A round's result as the task returns it (JSON-able)."""
    return {
        "status": result.status,
        "round_id": result.round_id,
        "model": result.model,
        "version_id": result.version_id,
        "samples": result.samples,
        "reward_mean": result.reward_mean,
        "watermark_from": result.watermark_from,
        "watermark_to": result.watermark_to,
        "seconds": dict(result.seconds),
        "error": result.error,
    }


def _run(settings: Settings, server_url: str, admin_key: str, trigger: Trigger) -> dict[str, Any]:
    config = round_config(settings, server_url=server_url, admin_key=admin_key, trigger=trigger)
    log.info("round starting", extra={"trigger": trigger, "server": server_url})
    done = summary(run_round(config))
    level = logging.WARNING if done["status"] == "failed" else logging.INFO
    log.log(level, "round ended", extra={"trigger": trigger, **done})
    return done


def _busy(exc: RoundError) -> dict[str, Any]:
    log.info("round not started: another round of the model is running", extra={"reason": str(exc)})
    return {"status": "busy", "error": str(exc)}


def _lock_holder_died(sessions: sessionmaker[Session], settings: Settings, model: str) -> bool:
    """Watch the model's running round until it heartbeats (alive: False) or goes stale (failed: True)."""
    deadline = time.monotonic() + settings.round_stale_timeout_s + settings.round_heartbeat_s
    seen: tuple[str, Any] | None = None
    while time.monotonic() < deadline:
        _fail_stale(sessions, settings)
        with sessions() as session:
            running = list_rounds(session, model=model, status="running", limit=1)
        if not running:
            return True
        now = (running[0].id, running[0].heartbeat_at)
        if seen is not None and now != seen:
            return False
        seen = now
        time.sleep(min(1.0, settings.round_heartbeat_s / 2))
    return False


def _fail_stale(sessions: sessionmaker[Session], settings: Settings) -> None:
    with sessions.begin() as session:
        failed = fail_stale_rounds(session, timeout=timedelta(seconds=settings.round_stale_timeout_s))
    for stale in failed:
        log.warning(
            "failed a round whose worker stopped heart-beating",
            extra={"round_id": stale.id, "model": stale.model, "worker_id": stale.worker_id},
        )


def _sessions(settings: Settings) -> tuple[sessionmaker[Session], Callable[[], None]]:
    db = make_engine(settings.resolved_database_url)
    return make_session_factory(db), db.dispose


def _worker_context(task: Task) -> tuple[Settings, str, str]:
    app = task.app
    if not isinstance(app, LearnerCelery) or app.server_url is None:
        raise RuntimeError("learner tasks run in `tandem worker`, whose app knows the server to learn for")
    key = app.tandem_settings.admin_key
    if key is None:
        raise RuntimeError("the worker has no admin key (TANDEM_ADMIN_KEY)")
    return app.tandem_settings, app.server_url, key.get_secret_value()
