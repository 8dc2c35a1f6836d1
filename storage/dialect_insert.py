"""``INSERT ... ON CONFLICT`` for the two dialects tandem runs on."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def dialect_insert(session: Session, model: type[Any]) -> Any:
    """The dialect's own insert into a mapped class's table, with ``on_conflict_do_nothing/do_update``.

    A Core insert on the table, not an ORM one: rows are keyed by column name ("metadata").
    """
    table = cast(Table, model.__table__)
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"unsupported database dialect {name!r}")
