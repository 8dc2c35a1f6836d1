"""Rounds and model versions for the admin API: filtered, newest first, paged by a cursor.

The cursor is the last id of the previous page; pages are cut on (created_at, id), so rows created
while an operator pages through are never skipped or repeated. Runs in the caller's transaction.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from storage.keyset import newest_first
from storage.learning_errors import NotFoundError
from storage.model_versions import ModelVersionView, get_version
from storage.models import ModelVersion, TrainingRound
from storage.rounds import TrainingRoundView

_ROUNDS: Table = TrainingRound.__table__  # type: ignore[assignment]
_VERSIONS: Table = ModelVersion.__table__  # type: ignore[assignment]
MAX_LINEAGE = 1000  # a guard against a parent cycle written by hand


def search_rounds(
    session: Session,
    *,
    model: str | None = None,
    status: str | None = None,
    trigger: str | None = None,
    since: datetime | None = None,
    before: str | None = None,
    limit: int = 50,
) -> tuple[TrainingRoundView, ...]:
    """Rounds created at or after ``since``, newest first, the page after round ``before``.

    Raises:
        NotFoundError: ``before`` is not a round id.
    """
    query = newest_first(select(_ROUNDS), _ROUNDS, session, before=before, limit=limit, what="round")
    for column, value in (("model", model), ("status", status), ("trigger", trigger)):
        if value is not None:
            query = query.where(_ROUNDS.c[column] == value)
    if since is not None:
        query = query.where(_ROUNDS.c.created_at >= since)
    return tuple(TrainingRoundView(**row._asdict()) for row in session.execute(query))


def search_versions(
    session: Session,
    *,
    model: str | None = None,
    status: str | None = None,
    before: str | None = None,
    limit: int = 50,
) -> tuple[ModelVersionView, ...]:
    """Versions newest first, the page after version ``before``.

    Raises:
        NotFoundError: ``before`` is not a version id.
    """
    query = newest_first(select(_VERSIONS), _VERSIONS, session, before=before, limit=limit, what="model version")
    if model is not None:
        query = query.where(_VERSIONS.c.model == model)
    if status is not None:
        query = query.where(_VERSIONS.c.status == status)
    return tuple(ModelVersionView(**row._asdict()) for row in session.execute(query))


def version_lineage(session: Session, *, version_id: str) -> tuple[ModelVersionView, ...]:
    """The version and its ancestors, child first, up to the first version without a (kept) parent.

    Raises:
        NotFoundError: no such version.
    """
    chain = [get_version(session, version_id=version_id)]
    seen = {version_id}
    while (parent := chain[-1].parent_id) is not None and parent not in seen and len(chain) < MAX_LINEAGE:
        seen.add(parent)
        try:
            chain.append(get_version(session, version_id=parent))
        except NotFoundError:  # the FK sets a deleted parent to NULL, so only a racing delete lands here
            break
    return tuple(chain)
