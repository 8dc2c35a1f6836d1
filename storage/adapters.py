"""LoRA adapters per scope, and cohorts: which adapter serves whom.

A scope is a user (``the user`` field, or the user bound to an API key), a cohort (a named set of a
tenant's users) or the whole tenant. A request is served by the most specific serving adapter:
the user's, else their cohort's, else the tenant's, else the base alone. Promotion keeps one
serving adapter per (model, tenant, scope kind, scope), as ``storage.model_versions`` does per model.

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Table, delete, select, update
from sqlalchemy.orm import Session

from storage.learning_errors import NotFoundError
from storage.model_versions import VersionStatus, status_change
from storage.models import Adapter, CohortMember
from storage.times import utcnow

ScopeKind = Literal["user", "cohort", "tenant"]

_ADAPTERS: Table = Adapter.__table__  # type: ignore[assignment]
_MEMBERS: Table = CohortMember.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class AdapterView:
    id: str
    model: str
    tenant_id: str
    scope_kind: str
    scope: str
    base_version_id: str | None
    parent_id: str | None
    checkpoint_path: str
    sha256: str | None
    status: str
    status_reason: str | None
    watermark: int | None
    ratings: int
    metrics: dict[str, Any]
    evaluation: dict[str, Any]
    created_at: datetime
    promoted_at: datetime | None
    retired_at: datetime | None


def record_adapter(
    session: Session,
    *,
    adapter_id: str,
    model: str,
    tenant_id: str,
    scope_kind: ScopeKind,
    scope: str,
    checkpoint_path: str,
    base_version_id: str | None = None,
    parent_id: str | None = None,
    sha256: str | None = None,
    watermark: int | None = None,
    ratings: int = 0,
    metrics: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> AdapterView:
    """A new candidate adapter (promote it with ``set_adapter_status``)."""
    session.execute(
        _ADAPTERS.insert().values(
            id=adapter_id,
            model=model,
            tenant_id=tenant_id,
            scope_kind=scope_kind,
            scope=scope,
            base_version_id=base_version_id,
            parent_id=parent_id,
            checkpoint_path=checkpoint_path,
            sha256=sha256,
            status="candidate",
            watermark=watermark,
            ratings=ratings,
            metrics=metrics or {},
            evaluation={},
            created_at=now or utcnow(),
        )
    )
    return get_adapter(session, adapter_id=adapter_id)


def set_adapter_status(
    session: Session,
    *,
    adapter_id: str,
    status: VersionStatus,
    reason: str | None = None,
    evaluation: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> AdapterView:
    """Change an adapter's status; ``serving`` retires its scope's serving adapter in the same transaction.

    Raises:
        NotFoundError: no such adapter.
    """
    now = now or utcnow()
    adapter = get_adapter(session, adapter_id=adapter_id)
    if status == "serving":
        _retire_serving(session, adapter, now, keep=adapter_id)
    values = status_change(status, reason, evaluation, now)
    session.execute(update(_ADAPTERS).where(_ADAPTERS.c.id == adapter_id).values(**values))
    return get_adapter(session, adapter_id=adapter_id)


def reset_scope(session: Session, *, model: str, tenant_id: str, scope_kind: ScopeKind, scope: str) -> str | None:
    """Retire the scope's serving adapter (the scope goes back to the next less specific one); its id."""
    serving = serving_adapter(session, model=model, tenant_id=tenant_id, scope_kind=scope_kind, scope=scope)
    if serving is not None:
        set_adapter_status(session, adapter_id=serving.id, status="retired", reason="reset to the base")
    return serving.id if serving else None


def _retire_serving(session: Session, adapter: AdapterView, now: datetime, *, keep: str) -> None:
    scope = (
        (_ADAPTERS.c.model == adapter.model)
        & (_ADAPTERS.c.tenant_id == adapter.tenant_id)
        & (_ADAPTERS.c.scope_kind == adapter.scope_kind)
        & (_ADAPTERS.c.scope == adapter.scope)
    )
    # Locking the scope's rows serialises concurrent promotions (as storage.model_versions does per model).
    session.execute(select(_ADAPTERS.c.id).where(scope).with_for_update()).all()
    session.execute(
        update(_ADAPTERS)
        .where(scope, _ADAPTERS.c.status == "serving", _ADAPTERS.c.id != keep)
        .values(status="retired", retired_at=now)
    )


def get_adapter(session: Session, *, adapter_id: str) -> AdapterView:
    row = session.execute(select(_ADAPTERS).where(_ADAPTERS.c.id == adapter_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no adapter {adapter_id}")
    return AdapterView(**row._asdict())


def serving_adapter(
    session: Session, *, model: str, tenant_id: str, scope_kind: ScopeKind, scope: str
) -> AdapterView | None:
    row = session.execute(
        select(_ADAPTERS).where(
            _ADAPTERS.c.model == model,
            _ADAPTERS.c.tenant_id == tenant_id,
            _ADAPTERS.c.scope_kind == scope_kind,
            _ADAPTERS.c.scope == scope,
            _ADAPTERS.c.status == "serving",
        )
    ).one_or_none()
    return None if row is None else AdapterView(**row._asdict())


def list_adapters(
    session: Session,
    *,
    model: str | None = None,
    tenant_id: str | None = None,
    scope_kind: ScopeKind | None = None,
    scope: str | None = None,
    status: str | None = None,
    limit: int = 100,
) -> tuple[AdapterView, ...]:
    """Newest first."""
    query = select(_ADAPTERS).order_by(_ADAPTERS.c.created_at.desc(), _ADAPTERS.c.id.desc()).limit(limit)
    for column, value in (
        (_ADAPTERS.c.model, model),
        (_ADAPTERS.c.tenant_id, tenant_id),
        (_ADAPTERS.c.scope_kind, scope_kind),
        (_ADAPTERS.c.scope, scope),
        (_ADAPTERS.c.status, status),
    ):
        if value is not None:
            query = query.where(column == value)
    return tuple(AdapterView(**row._asdict()) for row in session.execute(query))


def delete_user_adapters(session: Session, *, tenant_id: str, end_user: str) -> list[str]:
    """Delete every adapter row of one user (the user-data deletion); their folders, for the caller to remove."""
    mine = (_ADAPTERS.c.tenant_id == tenant_id) & (_ADAPTERS.c.scope_kind == "user") & (_ADAPTERS.c.scope == end_user)
    paths = list(session.scalars(select(_ADAPTERS.c.checkpoint_path).where(mine)))
    # Children first would be needed without ON DELETE SET NULL on parent_id; with it, one statement.
    session.execute(delete(_ADAPTERS).where(mine))
    return paths


def set_cohort(session: Session, *, tenant_id: str, cohort: str, users: Iterable[str]) -> list[str]:
    """Make ``users`` the whole membership of ``cohort`` (each leaves any other cohort); the sorted members."""
    members = sorted(set(users))
    session.execute(delete(_MEMBERS).where(_MEMBERS.c.tenant_id == tenant_id, _MEMBERS.c.cohort == cohort))
    if members:
        session.execute(delete(_MEMBERS).where(_MEMBERS.c.tenant_id == tenant_id, _MEMBERS.c.end_user.in_(members)))
        now = utcnow()
        session.execute(
            _MEMBERS.insert(),
            [{"tenant_id": tenant_id, "end_user": u, "cohort": cohort, "created_at": now} for u in members],
        )
    return members


def cohorts(session: Session, *, tenant_id: str | None = None) -> dict[tuple[str, str], list[str]]:
    """(tenant id, cohort) -> its sorted members."""
    query = select(_MEMBERS.c.tenant_id, _MEMBERS.c.cohort, _MEMBERS.c.end_user).order_by(_MEMBERS.c.end_user)
    if tenant_id is not None:
        query = query.where(_MEMBERS.c.tenant_id == tenant_id)
    found: dict[tuple[str, str], list[str]] = {}
    for tenant, cohort, user in session.execute(query):
        found.setdefault((tenant, cohort), []).append(user)
    return found


def leave_cohorts(session: Session, *, tenant_id: str, end_user: str) -> int:
    """Take ``end_user`` out of their cohort; how many memberships went (0 or 1)."""
    result: Any = session.execute(
        delete(_MEMBERS).where(_MEMBERS.c.tenant_id == tenant_id, _MEMBERS.c.end_user == end_user)
    )
    return int(result.rowcount)
