"""API keys: only a SHA-256 of each key is stored; the plaintext is shown once, at creation."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import ApiKey
from storage.tenants import ensure_tenant, tenant_by_name
from storage.times import utcnow

KEY_PREFIX = "tdm-"
DISPLAY_PREFIX_CHARS = 12


@dataclass(frozen=True, slots=True)
class ApiKeyIdentity:
    key_id: str
    tenant_id: str


def hash_api_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def create_api_key(session: Session, *, tenant_name: str, name: str) -> tuple[str, ApiKey]:
    """A new key for the tenant called ``tenant_name`` (created, with that name as its id, if new).

    Returns:
        The plaintext key (store it now: it cannot be recovered) and the stored row.
    """
    tenant = tenant_by_name(session, tenant_name) or ensure_tenant(session, tenant_name, tenant_name)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        id="key_" + secrets.token_hex(8),
        tenant_id=tenant.id,
        name=name,
        prefix=plaintext[:DISPLAY_PREFIX_CHARS],
        key_hash=hash_api_key(plaintext),
        created_at=utcnow(),
    )
    session.add(key)
    session.flush()
    return plaintext, key


def lookup_api_key(session: Session, plaintext: str) -> ApiKeyIdentity | None:
    """Who a presented key belongs to; None for unknown and revoked keys."""
    row = session.execute(
        select(ApiKey.id, ApiKey.tenant_id).where(
            ApiKey.key_hash == hash_api_key(plaintext), ApiKey.revoked_at.is_(None)
        )
    ).one_or_none()
    return ApiKeyIdentity(key_id=row.id, tenant_id=row.tenant_id) if row else None


def count_active_api_keys(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))) or 0


def list_api_keys(session: Session, *, tenant_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(session.scalars(query))


def revoke_api_key(session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key (idempotent: the first revocation time is kept); None if no such key."""
    key = session.get(ApiKey, key_id)
    if key is not None and key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def revoke_tenant_keys(session: Session, tenant_id: str) -> list[ApiKey]:
    """Revoke every active key of a tenant; returns the keys this call revoked."""
    keys = list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))))
    now = utcnow()
    for key in keys:
        key.revoked_at = now
    session.flush()
    return keys


def count_active_keys_by_tenant(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(ApiKey.tenant_id, func.count()).where(ApiKey.revoked_at.is_(None)).group_by(ApiKey.tenant_id)
    )
    return {tenant_id: count for tenant_id, count in rows}
