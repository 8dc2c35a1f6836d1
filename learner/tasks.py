"""The learner pool's Celery task ``tandem.learn``: one round now.

It runs against the server of the worker that executes it (``tandem worker --server``), with the
worker's settings and, when a schedule sent it, the schedule's round settings on top
(``learner.round_overrides``). The round's row records its trigger ("schedule" for a beat's firing,
"manual" for a round sent by hand or by the admin API's run-now) and the schedule's id. It returns a
JSON-able summary, ``status`` first:

- ``succeeded`` / ``nothing_to_learn`` / ``failed``: a round ran (round id, version, samples,
  watermarks, seconds per stage, error);
- ``busy``: another round of the model runs on a live worker (not an error: rounds are serialised).

With the round setting ``scope`` = ``personal`` (``TANDEM_LEARN_SCOPE``, or a schedule's
``round_settings``) the task runs a personal round instead (``learner.personal_round``): every due
user's and cohort's adapter; its summary lists the scopes, and its status is ``failed`` when a scope
failed, ``nothing_to_learn`` when none was due, else ``succeeded``. Personal rounds take no model
lock: a base round may run beside one (adapters follow the base they were trained on).

A server that cannot be reached fails the task (RoundError). When rounds are due is beat's business
(``learner.beat``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import httpx
from celery import Task, shared_task
from sqlalchemy.orm import Session, sessionmaker

from learner.celery_app import LEARN, LearnerCelery, Trigger
from learner.personal_round import PersonalRoundResult, run_personal_round
from learner.round import RoundError, RoundResult, run_round
from learner.round_overrides import with_round_settings
from learner.round_settings import personal_round_config, round_config
from storage import RoundBusyError, fail_stale_rounds, list_rounds, make_engine, make_session_factory
from tandem.settings import Settings

__all__ = ["learn", "learn_now", "personal_summary", "summary"]

log = logging.getLogger(__name__)


@shared_task(bind=True, name=LEARN)
def learn(
    self: Task,
    schedule_id: str | None = None,
    round_settings: Mapping[str, Any] | None = None,
    trigger: Trigger | None = None,
) -> dict[str, Any]:
    """Run one round now; a schedule's firing names the schedule and carries its round settings."""
    settings, server_url, admin_key = _worker_context(self)
    return learn_now(
        with_round_settings(settings, round_settings or {}),
        server_url=server_url,
        admin_key=admin_key,
        trigger=trigger or ("schedule" if schedule_id else "manual"),
        schedule_id=schedule_id,
    )


def learn_now(
    settings: Settings,
    *,
    server_url: str,
    admin_key: str,
    trigger: Trigger = "manual",
    schedule_id: str | None = None,
) -> dict[str, Any]:
    """One round; when the model's lock is held, wait to see whether its holder is alive.

    A task redelivered because its worker died can arrive before that worker's round is stale: it
    waits for the round to go stale (then fails it and runs) or to heartbeat (then answers "busy").

    Raises:
        RoundError: the server cannot be reached or refused the admin key.
    """
    sessions, dispose = _sessions(settings)

    def run() -> dict[str, Any]:
        return _run(settings, server_url, admin_key, trigger, schedule_id)

    try:
        _fail_stale(sessions, settings)
        try:
            return run()
        except RoundError as exc:
            if not isinstance(exc.__cause__, RoundBusyError):
                raise
            model = serving_model(server_url, admin_key)
            if not _lock_holder_died(sessions, settings, model):
                return _busy(exc)
        try:
            return run()
        except RoundError as exc:
            if isinstance(exc.__cause__, RoundBusyError):  # another worker took the freed lock first
                return _busy(exc)
            raise
    finally:
        dispose()


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
        "reason": result.reason,
    }


def personal_summary(result: PersonalRoundResult) -> dict[str, Any]:
    """A personal round's result as the task returns it (JSON-able)."""
    failed = any(s.status == "failed" for s in result.scopes)
    return {
        "status": "failed" if failed else "succeeded" if result.scopes else "nothing_to_learn",
        "scope": "personal",
        "base_version": result.base_version,
        "scopes": [dataclasses.asdict(s) for s in result.scopes],
        "seconds": result.seconds,
    }


def _run(
    settings: Settings, server_url: str, admin_key: str, trigger: Trigger, schedule_id: str | None
) -> dict[str, Any]:
    config = round_config(settings, server_url=server_url, admin_key=admin_key, trigger=trigger)
    config = dataclasses.replace(config, schedule_id=schedule_id)
    scope = settings.learner.scope
    log.info(
        "round starting", extra={"trigger": trigger, "schedule_id": schedule_id, "server": server_url, "scope": scope}
    )
    if scope == "personal":
        done = personal_summary(run_personal_round(personal_round_config(settings, config)))
    else:
        done = summary(run_round(config))
    level = logging.WARNING if done["status"] == "failed" else logging.INFO
    log.log(level, "round ended", extra={"trigger": trigger, "schedule_id": schedule_id, **done})
    return done


def _busy(exc: RoundError) -> dict[str, Any]:
    log.info("round not started: another round of the model is running", extra={"reason": str(exc)})
    return {"status": "busy", "error": str(exc)}


def _lock_holder_died(sessions: sessionmaker[Session], settings: Settings, model: str) -> bool:
    """Watch the model's running round until it heartbeats (alive: False) or goes stale (failed: True)."""
    deadline = time.monotonic() + settings.learner.round_stale_timeout_s + settings.learner.round_heartbeat_s
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
        time.sleep(min(1.0, settings.learner.round_heartbeat_s / 2))
    return False


def _fail_stale(sessions: sessionmaker[Session], settings: Settings) -> None:
    with sessions.begin() as session:
        failed = fail_stale_rounds(session, timeout=timedelta(seconds=settings.learner.round_stale_timeout_s))
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
    key = app.tandem_settings.server.admin_key
    if key is None:
        raise RuntimeError("the worker has no admin key (TANDEM_ADMIN_KEY)")
    return app.tandem_settings, app.server_url, key.get_secret_value()
