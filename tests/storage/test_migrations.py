from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from migrations.migrate import current_revision, downgrade, upgrade
from storage.db import make_engine
from storage.models import Base


def _schema_diffs(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    assert current_revision(url) is None
    upgrade(url)
    assert _tables(url) == set(Base.metadata.tables)
    assert _schema_diffs(url) == []
    downgrade(url, "base")
    assert _tables(url) == set()
    assert current_revision(url) is None
    upgrade(url, revision="head")
    assert _schema_diffs(url) == []
    assert current_revision(url) is not None


def test_sqlite_round_trip(sqlite_url: str) -> None:
    _round_trip(sqlite_url)


@pytest.mark.postgres
def test_postgres_round_trip(postgres_url: str) -> None:
    downgrade(postgres_url, "base")  # other tests may have migrated the shared database already
    _round_trip(postgres_url)
