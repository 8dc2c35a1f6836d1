from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine

from storage import list_admin_actions, record_admin_action
from storage.db import make_engine, make_session_factory
from storage.times import utcnow


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _action() -> str:
    # Each test its own action name: the PostgreSQL database is shared by the whole test session.
    return f"test.{uuid.uuid4().hex[:12]}"


def test_records_and_lists_newest_first(engine: Engine) -> None:
    action = _action()
    start = utcnow()
    with make_session_factory(engine).begin() as session:
        record_admin_action(session, actor="admin:ops", action=action, target="round-1", details={"reason": "x"})
        record_admin_action(
            session, actor="admin:ops", action=action, target="v2", details={"from": "v1"}, status_code=409
        )
    with make_session_factory(engine)() as session:
        rows = list_admin_actions(session, limit=10, action=action)
    assert [(r.target, r.status_code, r.details) for r in rows] == [
        ("v2", 409, {"from": "v1"}),
        ("round-1", 200, {"reason": "x"}),
    ]
    assert rows[0].id > rows[1].id
    assert all(r.actor == "admin:ops" and r.action == action for r in rows)
    assert all(start - timedelta(seconds=1) <= r.at <= utcnow() and r.at.tzinfo is not None for r in rows)


def test_pages_back_with_before(engine: Engine) -> None:
    action = _action()
    with make_session_factory(engine).begin() as session:
        for i in range(5):
            record_admin_action(session, actor="a", action=action, target=f"t{i}", details={})
    with make_session_factory(engine)() as session:
        first = list_admin_actions(session, limit=2, action=action)
        second = list_admin_actions(session, limit=2, before=first[-1].id, action=action)
        third = list_admin_actions(session, limit=2, before=second[-1].id, action=action)
    assert [r.target for r in first + second + third] == ["t4", "t3", "t2", "t1", "t0"]


def test_entry_rolls_back_with_the_action(engine: Engine) -> None:
    """Written in the action's transaction, an entry never outlives an effect that was rolled back."""
    action = _action()
    with pytest.raises(RuntimeError), make_session_factory(engine).begin() as session:
        record_admin_action(session, actor="a", action=action, target="t", details={})
        raise RuntimeError("the action failed after the entry was written")
    with make_session_factory(engine)() as session:
        assert list_admin_actions(session, action=action) == ()
