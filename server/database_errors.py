"""Database errors at the API's edge: a value the database refuses is the client's 400; any other
driver error is an outage, a 503 the client may retry, logged with the driver's own message.

Every route and service that runs database work for a request goes through ``database_call`` (or
``database_error`` where it has its own thread hop), so the two can never be confused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import DataError, DBAPIError

from server.errors import ApiError

__all__ = ["DATABASE_DOWN", "database_call", "database_error", "driver_message"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DATABASE_DOWN = "The database is unavailable; retry shortly."
RETRY_AFTER_S = "2"  # what a 503 tells the client to wait, as the API key check's does


def driver_message(exc: DBAPIError) -> str:
    """What the driver said, without SQLAlchemy's wrapper text (statement, parameters, autoflush hints)."""
    orig = exc.orig
    if orig is None:
        return str(exc)
    return f"{type(orig).__module__}.{type(orig).__name__}: {str(orig).strip()}"


def database_error(exc: DBAPIError, message: str = DATABASE_DOWN) -> ApiError:
    """The answer for ``exc``: 400 when the database refused a value (e.g. NUL in text on PostgreSQL,
    an integer out of range), else a 503 with ``message``, logged at ERROR since it needs an operator."""
    if isinstance(exc, DataError):
        # The driver's first line names the problem; later lines may quote the statement.
        reason = (str(exc.orig).strip().splitlines() or ["invalid value"])[0]
        return ApiError(400, f"The database refused a value of this request: {reason}", code="invalid_value")
    log.error("database unavailable: %s", driver_message(exc))
    return ApiError(503, message, code="database_unavailable", headers={"Retry-After": RETRY_AFTER_S})


async def database_call(fn: Callable[..., T], *args: Any, message: str = DATABASE_DOWN, **kwargs: Any) -> T:
    """Run blocking database work ``fn(*args, **kwargs)`` off the event loop; errors as ``database_error``."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except DBAPIError as exc:
        raise database_error(exc, message) from exc
