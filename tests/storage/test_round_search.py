from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, update

from storage import NotFoundError, cancel_round, queue_round, record_model_version
from storage.db import make_engine, make_session_factory
from storage.models import TrainingRound
from storage.round_search import search_rounds, search_versions, version_lineage
from storage.times import utcnow


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _model() -> str:
    # Each test its own model: the PostgreSQL database is shared by the whole test session.
    return f"m-{uuid.uuid4().hex[:12]}"


def test_rounds_filter_and_page_without_gaps_on_equal_times(engine: Engine) -> None:
    model = _model()
    with make_session_factory(engine).begin() as session:
        ids = [queue_round(session, model=model, trigger="schedule", round_id=f"{model}-{i}").id for i in range(5)]
        queue_round(session, model=model, trigger="manual", round_id=f"{model}-manual")
        cancel_round(session, round_id=ids[0])
        # The same created_at for all: only the id can order them, and paging must still see each once.
        session.execute(update(TrainingRound).where(TrainingRound.model == model).values(created_at=utcnow()))
    with make_session_factory(engine)() as session:
        seen: list[str] = []
        pages = 0
        before = None
        while True:
            page = search_rounds(session, model=model, trigger="schedule", before=before, limit=2)
            if not page:
                break
            seen += [r.id for r in page]
            pages += 1
            before = page[-1].id
        assert sorted(seen) == ids and len(seen) == 5 and pages == 3
        assert [r.id for r in search_rounds(session, model=model, status="cancelled")] == [ids[0]]
        assert len(search_rounds(session, model=model, since=utcnow() - timedelta(minutes=1))) == 6
        assert search_rounds(session, model=model, since=utcnow() + timedelta(minutes=1)) == ()
        with pytest.raises(NotFoundError):
            search_rounds(session, before="round-unknown")


def test_versions_page_and_lineage(engine: Engine) -> None:
    model = _model()
    start = utcnow()
    with make_session_factory(engine).begin() as session:
        parent = None
        for i in range(4):
            version = f"{model}-v{i}"
            record_model_version(
                session,
                version_id=version,
                model=model,
                checkpoint_path="/x",
                parent_id=parent,
                now=start + timedelta(seconds=i),
            )
            parent = version
    with make_session_factory(engine)() as session:
        first = search_versions(session, model=model, limit=3)
        rest = search_versions(session, model=model, before=first[-1].id, limit=3)
        assert [v.id for v in first + rest] == [f"{model}-v{i}" for i in (3, 2, 1, 0)]
        assert [v.id for v in version_lineage(session, version_id=f"{model}-v2")] == [
            f"{model}-v2",
            f"{model}-v1",
            f"{model}-v0",
        ]
        with pytest.raises(NotFoundError):
            version_lineage(session, version_id="v-unknown")
