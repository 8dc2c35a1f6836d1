"""server.database_errors on real databases: a refused value is the client's 400, an unreachable
database a 503 whose log line carries the driver's message, not SQLAlchemy's wrapper text."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from server.database_errors import DATABASE_DOWN, database_call
from server.errors import ApiError
from storage.db import make_engine, make_session_factory


def scalar(sessions: sessionmaker[Session], statement: str, **params: object) -> object:
    with sessions() as session:
        return session.execute(text(statement), params).scalar()


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("statement", "value"),
    [("SELECT CAST(:value AS text)", "a\0b"), ("SELECT CAST(:value AS bigint)", str(2**70))],
)
async def test_a_value_the_database_refuses_is_400(postgres_url: str, statement: str, value: str) -> None:
    sessions = make_session_factory(make_engine(postgres_url))
    with pytest.raises(ApiError) as caught:
        await database_call(scalar, sessions, statement, value=value)
    assert (caught.value.status, caught.value.code) == (400, "invalid_value")
    assert "SELECT" not in caught.value.message  # the driver's reason, not the statement


@pytest.mark.parametrize(
    ("url", "driver_says"),
    [
        ("sqlite:///{tmp}/no/such/dir/tandem.db", "unable to open database file"),
        pytest.param("postgresql://postgres@127.0.0.1:1/tandem", "Connection refused", marks=pytest.mark.postgres),
    ],
)
async def test_an_outage_is_503_and_logs_the_driver_error(
    url: str, driver_says: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = make_session_factory(make_engine(url.format(tmp=tmp_path)))
    with caplog.at_level(logging.ERROR, logger="server.database_errors"), pytest.raises(ApiError) as caught:
        await database_call(scalar, sessions, "SELECT 1")
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        503,
        "database_unavailable",
        DATABASE_DOWN,
    )
    assert caught.value.headers == {"Retry-After": "2"}
    [line] = [record for record in caplog.records if record.name == "server.database_errors"]
    assert line.levelno == logging.ERROR
    assert driver_says in line.getMessage()
    assert "sqlalche.me" not in line.getMessage() and "[SQL:" not in line.getMessage()
