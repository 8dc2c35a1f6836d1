"""count_feedback_since: what the learner's due check counts, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from storage import count_feedback_since, last_watermark
from storage.db import make_engine, make_session_factory
from tests.storage.factories import feedback, new_tenant
from tests.storage.test_learning import _completion, _model, _run_round, _write


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _count(engine: Engine, model: str) -> int:
    with make_session_factory(engine)() as session:
        return count_feedback_since(session, model=model, since=last_watermark(session, model=model))


def test_counts_rated_choices_since_the_watermark_once_each(engine: Engine) -> None:
    tenant, model, other = new_tenant(), _model(), _model()
    a, b, unrated, elsewhere = (_completion(tenant, m) for m in (model, model, model, other))
    assert _count(engine, model) == 0

    _write(engine, [a, b, unrated, elsewhere], [feedback(a, score=1.0, rating="up"), feedback(elsewhere, score=1.0)])
    assert _count(engine, model) == 1 and _count(engine, other) == 1
    # A second change of the same choice is still one rated answer; b's rating makes two.
    _write(engine, [], [feedback(a, score=-1.0, rating="down"), feedback(b, score=0.5)])
    assert _count(engine, model) == 2

    assert len(_run_round(engine, model).items) == 2  # the round consumes them: nothing new after it
    assert _count(engine, model) == 0 and _count(engine, other) == 1
    _write(engine, [], [feedback(b, score=-0.5)])
    assert _count(engine, model) == 1
