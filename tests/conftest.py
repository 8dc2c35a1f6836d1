"""Shared fixtures: real SQLite files, a throwaway PostgreSQL database, and sessions on either (no torch imports here)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.orm import Session, sessionmaker

from migrations.migrate import upgrade
from storage.db import make_engine, make_session_factory

POSTGRES_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=5"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """An empty SQLite database file."""
    return f"sqlite:///{tmp_path / 'tandem.db'}"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, empty database ``tandem_test_<random>`` on the local PostgreSQL, dropped afterwards.

    Shared by the whole test session: tests keep apart by using their own tenant and record ids.
    """
    name = f"tandem_test_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_DSN, autocommit=True)
    except psycopg.OperationalError as exc:
        message = f"PostgreSQL at 127.0.0.1:5432 (user postgres, database test) is unreachable: {exc}"
        if _in_ci():
            pytest.fail(f"{message}; CI must run the PostgreSQL tests", pytrace=False)
        pytest.skip(message)
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database migrated to head, on each backend in turn."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tandem.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    upgrade(url)
    return url


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The random order's seed, even under -q (which hides pytest-randomly's header): rerun a failing
    order with ``pytest --randomly-seed=N``."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None:
        terminalreporter.write_line(f"test order: --randomly-seed={seed}")


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on ``database_url`` (each database the test is parametrized over)."""
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()
