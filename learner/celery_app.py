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
instead of deleting it and never shows it again: a task whose worker dies is lost, which beat's next
``learn_if_due`` makes up for (the feedback stays unconsumed). See docs/learner-pool.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import Celery

from tandem.settings import Settings

__all__ = ["LEARN", "LEARN_IF_DUE", "QUEUE", "LearnerCelery", "broker_urls", "create_celery_app"]

QUEUE = "tandem.learner"
LEARN = "tandem.learn"
LEARN_IF_DUE = "tandem.learn_if_due"


class LearnerCelery(Celery):
    """A Celery app that carries the settings, and the server its worker learns for (None: a sender)."""

    def __init__(self, settings: Settings, *, server_url: str | None = None, **kwargs: Any) -> None:
        super().__init__("tandem", **kwargs)
        self.tandem_settings = settings
        self.server_url = server_url


def broker_urls(settings: Settings) -> tuple[str, str]:
    """``(broker_url, result_backend)`` for these settings."""
    if settings.redis_url:
        return settings.redis_url, settings.redis_url
    return (
        f"sqla+sqlite:///{settings.data_dir / 'celery-broker.sqlite'}",
        f"db+sqlite:///{settings.data_dir / 'celery-results.sqlite'}",
    )


def create_celery_app(settings: Settings, *, server_url: str | None = None) -> LearnerCelery:
    """The app for a worker (``server_url`` given) or for sending tasks (``server_url=None``)."""
    broker, backend = broker_urls(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # SQLite and beat create files, not folders
    app = LearnerCelery(settings, server_url=server_url, include=["learner.tasks"])
    interval = settings.learn_check_interval_s
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        broker_transport_options=_transport_options(settings),
        result_backend_transport_options={"global_keyprefix": settings.redis_key_prefix} if settings.redis_url else {},
        # A worker that cannot reach its broker at start says so instead of retrying forever.
        broker_connection_retry_on_startup=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_track_started=True,
        result_expires=timedelta(days=1),
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        beat_schedule={
            "learn-if-due": {
                "task": LEARN_IF_DUE,
                "schedule": interval,
                # Checks queued behind a long round are stale by the time it ends: drop them.
                "options": {"expires": interval},
            }
        },
        beat_schedule_filename=str(settings.data_dir / "celerybeat-schedule"),
    )
    return app


def _transport_options(settings: Settings) -> dict[str, Any]:
    if not settings.redis_url:
        return {}
    visibility = settings.celery_visibility_timeout_s
    return {
        "visibility_timeout": visibility,
        "global_keyprefix": settings.redis_key_prefix,
        # Idle workers look for overdue unacknowledged tasks this often (kombu's default: every 100 s).
        "unacked_restore_interval": max(1, min(60, int(visibility / 10))),
        "unacked_restore_throttle": 1,
    }
