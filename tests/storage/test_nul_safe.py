"""storage.nul_safe's column types keep SQLAlchemy's statement cache on every statement that uses them
(without ``cache_ok`` on each class, SQLAlchemy warns and compiles the statement every time)."""

from __future__ import annotations

import warnings

from sqlalchemy import select
from sqlalchemy.exc import SAWarning

from storage.db import make_engine, make_session_factory
from storage.models import AdminAuditEntry, DataDeletion, EndUser, ModelVersion


def test_queries_on_nul_safe_columns_warn_nothing(database_url: str) -> None:
    db = make_engine(database_url)
    try:
        with warnings.catch_warnings(), make_session_factory(db)() as session:
            warnings.simplefilter("error", SAWarning)
            session.scalars(select(EndUser).where(EndUser.external_id == "a\0b")).all()  # NulSafeString
            session.scalars(select(AdminAuditEntry).where(AdminAuditEntry.target == "t\0")).all()
            session.scalars(select(DataDeletion).where(DataDeletion.end_user == "u\0")).all()  # NulSafeString
            session.scalars(select(ModelVersion).where(ModelVersion.checkpoint_path == "p\0")).all()  # NulSafeText
            session.scalars(select(AdminAuditEntry.details)).all()  # NulSafeJson
    finally:
        db.dispose()
