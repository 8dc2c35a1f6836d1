"""Fixtures of the storage tests that work on one database at a time (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage.tenants import ensure_tenant


@pytest.fixture
def tenant(sessions: sessionmaker[Session]) -> str:
    tenant_id = f"t-{uuid.uuid4().hex[:8]}"
    with sessions.begin() as session:
        ensure_tenant(session, tenant_id)
    return tenant_id
