"""Request limits of tenants and API keys, as the admin API sets them and the gateway reads them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.dialect_insert import dialect_insert
from storage.models import RateLimit
from storage.times import utcnow

Scope = Literal["tenant", "key"]


@dataclass(frozen=True, slots=True)
class Limits:
    """None: no limit of that kind."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


NO_LIMITS = Limits()


def _limits(row: RateLimit | None) -> Limits | None:
    if row is None:
        return None
    return Limits(row.requests_per_minute, row.tokens_per_minute, row.max_concurrent_requests)


def get_limits(session: Session, scope: Scope, subject_id: str) -> Limits | None:
    """The limits stored for a tenant or key; None when none are (the deployment's defaults apply)."""
    return _limits(session.get(RateLimit, (scope, subject_id)))


def set_limits(session: Session, scope: Scope, subject_id: str, limits: Limits) -> Limits:
    values = {f.name: getattr(limits, f.name) for f in fields(Limits)}
    insert = dialect_insert(session, RateLimit).values(
        scope=scope, subject_id=subject_id, updated_at=utcnow(), **values
    )
    updated = {**values, "updated_at": utcnow()}
    session.execute(insert.on_conflict_do_update(index_elements=["scope", "subject_id"], set_=updated))
    return limits


def clear_limits(session: Session, scope: Scope, subject_id: str) -> bool:
    """Remove stored limits; True if there were any."""
    result = session.execute(delete(RateLimit).where(RateLimit.scope == scope, RateLimit.subject_id == subject_id))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def limits_of_key(session: Session, tenant_id: str, key_id: str) -> tuple[Limits | None, Limits | None]:
    """(tenant's, key's) stored limits, in one query."""
    rows = session.scalars(
        select(RateLimit).where(
            ((RateLimit.scope == "tenant") & (RateLimit.subject_id == tenant_id))
            | ((RateLimit.scope == "key") & (RateLimit.subject_id == key_id))
        )
    ).all()
    found = {row.scope: row for row in rows}
    return _limits(found.get("tenant")), _limits(found.get("key"))
