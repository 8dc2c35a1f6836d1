"""The learner pool's Celery app, built from Settings.

Broker and results: Redis when ``TANDEM_REDIS_URL`` is set (a pool of workers on many machines);
otherwise kombu's SQLAlchemy transport over SQLite files in the data dir, which needs nothing
installed (one machine: `tandem serve` and its worker child, or a few `tandem worker` processes).

Delivery is at least once where the broker allows it: a task is acknowledged when it *ends*
(``task_acks_late``), one at a time per worker process (prefetch 1). On Redis an unacknowledged task
goes back to the queue ``celery_visibility_timeout_s`` after it was delivered, so the task of a
worker that was SIGKILLed runs again on another worker; rounds are idempotent (the watermark only
moves when one succeeds), and a copy delivered while the first still runs finds the model's round
lock held by a live worker and ends as "busy". The SQLite transport hides a delivered message
instead of deleting it and never shows it again: a task whose worker dies is lost; the feedback stays
unconsumed, and the schedule's next firing learns from it. See docs/learner-pool.md.

Beat runs ``learner.beat.DatabaseScheduler``: the training schedules stored in the database
(docs/schedules.md), not a fixed ``beat_schedule``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Literal

from celery import Celery

from tandem.settings import Settings

__all__ = ["LEARN", "QUEUE", "LearnerCelery", "Trigger", "broker_urls", "create_celery_app", "send_learn"]

QUEUE = "tandem.learner"
LEARN = "tandem.learn"
BEAT_SCHEDULER = "learner.beat:DatabaseScheduler"

Trigger = Literal["manual", "schedule"]


class LearnerCelery(Celery):
    """A Celery app that carries the settings, and the server its worker learns for (None: a sender)."""

    def __init__(self, settings: Settings, *, server_url: str | None = None, **kwargs: Any) -> None:
        super().__init__("tandem", **kwargs)
        self.tandem_settings = settings
        self.server_url = server_url


def broker_urls(settings: Settings) -> tuple[str, str]:
    """``(broker_url, result_backend)`` for these settings."""
    if settings.learner.redis_url:
        return settings.learner.redis_url, settings.learner.redis_url
    return (
        f"sqla+sqlite:///{settings.storage.data_dir / 'celery-broker.sqlite'}",
        f"db+sqlite:///{settings.storage.data_dir / 'celery-results.sqlite'}",
    )


def create_celery_app(settings: Settings, *, server_url: str | None = None) -> LearnerCelery:
    """The app for a worker (``server_url`` given) or for sending tasks (``server_url=None``)."""
    broker, backend = broker_urls(settings)
    settings.storage.data_dir.mkdir(parents=True, exist_ok=True)  # SQLite and beat create files, not folders
    app = LearnerCelery(settings, server_url=server_url, include=["learner.tasks"])
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        broker_transport_options=_transport_options(settings),
        result_backend_transport_options={"global_keyprefix": settings.learner.redis_key_prefix}
        if settings.learner.redis_url
        else {},
        # A worker that cannot reach its broker at start says so instead of retrying forever.
        broker_connection_retry_on_startup=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A round keeps training when the broker goes away (Celery 6 would cancel it): the copy the
        # broker redelivers finds the round lock and watermark and trains nothing twice.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_track_started=True,
        result_expires=timedelta(days=1),
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        beat_scheduler=BEAT_SCHEDULER,
        beat_max_loop_interval=settings.learner.check_interval_s,
    )
    return app


def send_learn(
    app: Celery,
    *,
    task_id: str,
    trigger: Trigger,
    schedule_id: str | None = None,
    round_settings: Mapping[str, Any] | None = None,
    expires: datetime | None = None,
    producer: Any = None,
) -> None:
    """Send ``tandem.learn``: a round with the schedule's round settings over the worker's settings.

    ``expires``: a worker drops the task when it arrives later (a firing superseded by the next one).
    """
    kwargs = {"schedule_id": schedule_id, "round_settings": dict(round_settings or {}), "trigger": trigger}
    app.send_task(LEARN, kwargs=kwargs, task_id=task_id, expires=expires, producer=producer)


def _transport_options(settings: Settings) -> dict[str, Any]:
    if not settings.learner.redis_url:
        return {}
    visibility = settings.learner.celery_visibility_timeout_s
    return {
        "visibility_timeout": visibility,
        "global_keyprefix": settings.learner.redis_key_prefix,
        # Idle workers look for overdue unacknowledged tasks this often (kombu's default: every 100 s).
        "unacked_restore_interval": max(1, min(60, int(visibility / 10))),
        "unacked_restore_throttle": 1,
    }
