"""``INSERT ... ON CONFLICT`` for the two dialects tandem runs on."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def dialect_insert(session: Session, table: Table) -> Any:
    """The dialect's own insert construct, which has ``on_conflict_do_nothing/do_update``."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"unsupported database dialect {name!r}")
