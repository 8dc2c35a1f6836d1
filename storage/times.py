"""Timezone-aware UTC datetimes, also on SQLite (which stores them without an offset)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


def from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Refuses naive datetimes on the way in; always hands back aware UTC datetimes."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: tandem stores timezone-aware UTC datetimes only")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        stored: datetime = value  # the driver hands back a datetime for this column
        return stored.replace(tzinfo=UTC) if stored.tzinfo is None else stored.astimezone(UTC)
