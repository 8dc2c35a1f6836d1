"""Keyset pages for the admin listings: newest first, cut on (created_at, id).

Rows created while an operator pages through are never skipped or repeated, which an offset would
do. Runs in the caller's transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, Table, and_, or_, select
from sqlalchemy.orm import Session

from storage.learning_errors import NotFoundError

__all__ = ["newest_first"]


def newest_first(
    query: Select[Any], table: Table, session: Session, *, before: str | None, limit: int, what: str
) -> Select[Any]:
    """``query`` ordered newest first, limited, from the row after ``before`` (an id of ``table``).

    Raises:
        NotFoundError: ``before`` is not an id of ``table`` (``what`` names the row in the message).
    """
    query = query.order_by(table.c.created_at.desc(), table.c.id.desc()).limit(limit)
    if before is None:
        return query
    cursor = session.scalar(select(table.c.created_at).where(table.c.id == before))
    if cursor is None:
        raise NotFoundError(f"no {what} {before} to page from")
    after: ColumnElement[bool] = or_(
        table.c.created_at < cursor, and_(table.c.created_at == cursor, table.c.id < before)
    )
    return query.where(after)
