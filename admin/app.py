"""The gateway with the admin API mounted: what ``tandem serve`` and the live-gateway tests run.

The server must not import admin (admin calls into server, never the reverse), so the admin room
builds the full app: the server's app, then the admin routers on top, sharing its error handlers,
middleware, authentication and services (``app.state``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from admin.routes import router
from learner.celery_app import create_celery_app
from server.app import create_app as create_server_app
from tandem.settings import Settings

__all__ = ["create_app"]


def create_app(settings: Settings, **kwargs: Any) -> FastAPI:
    """``server.app.create_app(settings, **kwargs)`` plus the admin API under ``/admin``.

    Raises:
        StartupError: as ``server.app.create_app``.
    """
    app = create_server_app(settings, **kwargs)
    # Sends run-now rounds to the learner pool; its settings check the round settings of schedules.
    app.state.learner = create_celery_app(settings)
    app.include_router(router)
    return app
