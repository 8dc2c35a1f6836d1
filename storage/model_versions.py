"""Model versions: candidates, the one serving version per model, promotion and rollback.

Promotion keeps exactly one serving version per model: ``set_version_status(status="serving")``
locks the model's version rows, retires the serving one and promotes the new one in the caller's
transaction; a unique partial index on ``model_versions(model) WHERE status = 'serving'`` backs it.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Table, select, update
from sqlalchemy.orm import Session

from storage.learning_errors import NotFoundError
from storage.models import ModelVersion
from storage.times import utcnow

VersionStatus = Literal["candidate", "serving", "retired", "rejected"]

_VERSIONS: Table = ModelVersion.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class ModelVersionView:
    id: str
    model: str
    parent_id: str | None
    checkpoint_path: str
    sha256: str | None
    status: str
    status_reason: str | None
    watermark: int | None
    metrics: dict[str, Any]
    evaluation: dict[str, Any]
    created_at: datetime
    promoted_at: datetime | None
    retired_at: datetime | None


def record_model_version(
    session: Session,
    *,
    version_id: str,
    model: str,
    checkpoint_path: str,
    sha256: str | None = None,
    parent_id: str | None = None,
    watermark: int | None = None,
    metrics: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> ModelVersionView:
    """A new candidate version (promote it with ``set_version_status``)."""
    session.execute(
        _VERSIONS.insert().values(
            id=version_id,
            model=model,
            parent_id=parent_id,
            checkpoint_path=checkpoint_path,
            sha256=sha256,
            status="candidate",
            watermark=watermark,
            metrics=metrics or {},
            evaluation=evaluation or {},
            created_at=now or utcnow(),
        )
    )
    return get_version(session, version_id=version_id)


def set_version_status(
    session: Session,
    *,
    version_id: str,
    status: VersionStatus,
    reason: str | None = None,
    evaluation: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> ModelVersionView:
    """Change a version's status; ``serving`` retires the model's serving version in the same transaction.

    Promoting an earlier (retired) version is a rollback.

    Raises:
        NotFoundError: no such version.
    """
    now = now or utcnow()
    model = get_version(session, version_id=version_id).model
    if status == "serving":
        _retire_serving(session, model, version_id, now)
    values = status_change(status, reason, evaluation, now)
    session.execute(update(_VERSIONS).where(_VERSIONS.c.id == version_id).values(**values))
    return get_version(session, version_id=version_id)


def status_change(
    status: VersionStatus, reason: str | None, evaluation: dict[str, Any] | None, now: datetime
) -> dict[str, Any]:
    """The columns a status change writes (a version's or an adapter's: both follow these rules)."""
    values: dict[str, Any] = {"status": status, "status_reason": reason}
    if evaluation is not None:
        values["evaluation"] = evaluation
    if status == "serving":
        values.update(promoted_at=now, retired_at=None)
    elif status == "retired":
        values["retired_at"] = now
    return values


def _retire_serving(session: Session, model: str, keep: str, now: datetime) -> None:
    # Locking every version row of the model serialises concurrent promotions; the UPDATE after it
    # is a new statement, so it sees (and retires) what a promotion that went first committed.
    session.execute(select(_VERSIONS.c.id).where(_VERSIONS.c.model == model).with_for_update()).all()
    session.execute(
        update(_VERSIONS)
        .where(_VERSIONS.c.model == model, _VERSIONS.c.status == "serving", _VERSIONS.c.id != keep)
        .values(status="retired", retired_at=now)
    )


def serving_version(session: Session, *, model: str) -> ModelVersionView | None:
    row = session.execute(
        select(_VERSIONS).where(_VERSIONS.c.model == model, _VERSIONS.c.status == "serving")
    ).one_or_none()
    return None if row is None else ModelVersionView(**row._asdict())


def get_version(session: Session, *, version_id: str) -> ModelVersionView:
    row = session.execute(select(_VERSIONS).where(_VERSIONS.c.id == version_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no model version {version_id}")
    return ModelVersionView(**row._asdict())


def list_versions(
    session: Session, *, model: str | None = None, status: str | None = None, limit: int = 100
) -> tuple[ModelVersionView, ...]:
    """Newest first."""
    query = select(_VERSIONS).order_by(_VERSIONS.c.created_at.desc(), _VERSIONS.c.id).limit(limit)
    if model is not None:
        query = query.where(_VERSIONS.c.model == model)
    if status is not None:
        query = query.where(_VERSIONS.c.status == status)
    return tuple(ModelVersionView(**row._asdict()) for row in session.execute(query))
