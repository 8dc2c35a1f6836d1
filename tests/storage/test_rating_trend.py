"""rating_trend: rated answers per weight version, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from storage.db import make_engine, make_session_factory
from storage.model_versions import record_model_version, set_version_status
from storage.rating_trend import rating_trend
from storage.records import CompletionRecord
from tests.storage.factories import feedback, new_tenant
from tests.storage.test_learning import _completion, _model, _write


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _answer(tenant: str, model: str, version: str, created_at: float) -> CompletionRecord:
    rec = _completion(tenant, model, created_at=created_at)
    rec.weight_version = version
    return rec


def test_one_point_per_version_oldest_first_with_the_current_ratings(engine: Engine) -> None:
    tenant, model, other = new_tenant(), _model(), _model()
    base, v1 = f"base-{uuid.uuid4().hex[:8]}", f"v1-{uuid.uuid4().hex[:8]}"
    with make_session_factory(engine).begin() as session:
        record_model_version(session, version_id=v1, model=model, checkpoint_path="/ckpt/v1")
        set_version_status(session, version_id=v1, status="serving")
    t0 = time.time() - 100
    # v1 answered after base; an unrated answer and another model's answer stay out.
    b1, b2 = _answer(tenant, model, base, t0), _answer(tenant, model, base, t0 + 1)
    n1, n2, n3 = (_answer(tenant, model, v1, t0 + 10 + i) for i in range(3))
    unrated, elsewhere = _answer(tenant, model, v1, t0 + 20), _answer(tenant, other, v1, t0 + 30)
    ratings = [
        feedback(b1, score=-1.0, rating="down"),
        feedback(b2, score=1.0, rating="up"),
        feedback(n1, score=1.0, rating="up"),
        feedback(n2, score=1.0, rating="up"),
        feedback(n3, score=-0.5),
        feedback(elsewhere, score=-1.0, rating="down"),
    ]
    _write(engine, [b1, b2, n1, n2, n3, unrated, elsewhere], ratings)
    # A changed rating replaces the old one: b1 is now up, counted once.
    _write(engine, [], [feedback(b1, score=1.0, rating="up")])

    with make_session_factory(engine)() as session:
        points = rating_trend(session, model=model)
        everything = rating_trend(session)

    assert [(p.weight_version, p.status, p.rated, p.up, p.down) for p in points] == [
        (base, None, 2, 2, 0),
        (v1, "serving", 3, 2, 1),
    ]
    assert points[0].mean_score == pytest.approx(1.0) and points[1].mean_score == pytest.approx(0.5)
    assert points[1].first_at.timestamp() == pytest.approx(t0 + 10, abs=1e-3)
    assert points[1].last_at.timestamp() == pytest.approx(t0 + 12, abs=1e-3)
    assert points[0].first_at.tzinfo is not None
    assert {(p.model, p.weight_version) for p in everything} >= {(model, base), (model, v1), (other, v1)}


def test_no_ratings_no_points(engine: Engine) -> None:
    tenant, model = new_tenant(), _model()
    _write(engine, [_answer(tenant, model, "v-unrated", time.time())], [])
    with make_session_factory(engine)() as session:
        assert rating_trend(session, model=model) == []
