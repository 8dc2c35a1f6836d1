from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.api_keys import (
    count_active_api_keys,
    create_api_key,
    list_api_keys,
    lookup_api_key,
    revoke_api_key,
)
from storage.db import make_engine, make_session_factory
from storage.models import ApiKey, Tenant
from storage.tenants import DEFAULT_TENANT_ID, ensure_tenant
from tests.storage.factories import new_tenant


@pytest.fixture
def session(database_url: str) -> Iterator[Session]:
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        yield session
        session.rollback()
    engine.dispose()


def test_create_lookup_revoke(session: Session) -> None:
    tenant = new_tenant()
    active_before = count_active_api_keys(session)
    plaintext, key = create_api_key(session, tenant_name=tenant, name="ci")
    assert plaintext.startswith("tdm-") and len(plaintext) > 40
    assert plaintext.startswith(key.prefix) and plaintext not in (key.key_hash, key.prefix)
    assert session.scalars(select(ApiKey.key_hash).where(ApiKey.key_hash == plaintext)).first() is None

    identity = lookup_api_key(session, plaintext)
    assert identity is not None and (identity.key_id, identity.tenant_id) == (key.id, tenant)
    assert lookup_api_key(session, plaintext + "x") is None
    assert count_active_api_keys(session) == active_before + 1
    assert [k.id for k in list_api_keys(session, tenant_id=tenant)] == [key.id]

    revoked = revoke_api_key(session, key.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert revoked.revoked_at.tzinfo is not None
    assert lookup_api_key(session, plaintext) is None
    assert count_active_api_keys(session) == active_before
    assert revoke_api_key(session, "key_missing") is None


def test_second_key_reuses_tenant(session: Session) -> None:
    tenant = new_tenant()
    _, first = create_api_key(session, tenant_name=tenant, name="a")
    _, second = create_api_key(session, tenant_name=tenant, name="b")
    assert first.tenant_id == second.tenant_id == tenant
    assert first.key_hash != second.key_hash


def test_ensure_tenant(session: Session) -> None:
    assert ensure_tenant(session, DEFAULT_TENANT_ID).name == DEFAULT_TENANT_ID
    tenant = new_tenant()
    assert ensure_tenant(session, tenant, "Acme " + tenant).name == "Acme " + tenant
    assert ensure_tenant(session, tenant, "ignored").name == "Acme " + tenant
    assert session.get(Tenant, tenant) is not None
    with pytest.raises(ValueError, match="is taken"):
        ensure_tenant(session, new_tenant(), "Acme " + tenant)
