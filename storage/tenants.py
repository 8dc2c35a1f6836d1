"""Tenants: every key, completion and rating belongs to one."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.dialect_insert import dialect_insert
from storage.models import Tenant
from storage.times import utcnow

DEFAULT_TENANT_ID = "default"


def ensure_tenant(session: Session, tenant_id: str, name: str | None = None) -> Tenant:
    """The tenant with this id, created (named ``name``, default the id) if it does not exist yet."""
    insert = dialect_insert(session, Tenant)
    session.execute(insert.values(id=tenant_id, name=name or tenant_id, created_at=utcnow()).on_conflict_do_nothing())
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise ValueError(f"cannot create tenant {tenant_id!r}: the name {name or tenant_id!r} is taken")
    return tenant


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    return session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id)))


def server_tools_of(session: Session, tenant_id: str) -> frozenset[str]:
    """The gateway tools enabled for the tenant (none for an unknown tenant)."""
    names = session.scalar(select(Tenant.server_tools).where(Tenant.id == tenant_id))
    return frozenset(names or ())


def set_server_tools(session: Session, tenant: Tenant, names: list[str]) -> None:
    tenant.server_tools = sorted(set(names))


def tenants_by_server_tool(session: Session) -> dict[str, list[str]]:
    """Tool name -> the ids of the tenants it is enabled for."""
    enabled: dict[str, list[str]] = {}
    for tenant_id, names in session.execute(select(Tenant.id, Tenant.server_tools).order_by(Tenant.id)):
        for name in names or ():
            enabled.setdefault(name, []).append(tenant_id)
    return enabled
