from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from server.conversation_log import ConversationLog
from storage.completions import get_completion_view
from storage.db import make_engine, make_session_factory
from storage.models import Completion
from tests.storage.factories import completion, feedback, new_tenant


def _stored(url: str, tenant: str) -> int:
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            return (
                session.scalar(select(func.count()).select_from(Completion).where(Completion.tenant_id == tenant)) or 0
            )
    finally:
        engine.dispose()


@pytest.fixture
async def log(database_url: str, tmp_path: Path) -> AsyncIterator[ConversationLog]:
    log = ConversationLog(database_url, tmp_path / "journal", flush_interval_s=0.01)
    await log.start()
    yield log
    await log.close()


async def test_records_land_with_exact_tokens(log: ConversationLog, database_url: str) -> None:
    tenant = new_tenant()
    rec = completion(tenant, session_key="s", end_user="u")
    await log.record_completion(rec)
    assert log.pending_completion_tenant(rec.id) == tenant
    for score in (1.0, -1.0):
        await log.record_feedback(feedback(rec, score=score))
    assert await log.flush(10)
    assert log.backlog() == 0 and log.db_available
    assert log.pending_completion_tenant(rec.id) is None

    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        view = get_completion_view(session, tenant_id=tenant, completion_id=rec.id)
    engine.dispose()
    assert view is not None
    assert view.prompt_token_ids == rec.prompt_token_ids
    assert view.choices[0].token_ids == rec.choices[0].token_ids
    assert view.choices[0].logprobs == array("f", rec.choices[0].logprobs).tolist()
    current = view.choices[0].feedback
    assert current is not None and current.score == -1.0 and current.revision == 2
    assert [e.score for e in current.history] == [1.0, -1.0]


async def test_fsync_always_and_segment_rotation(sqlite_url: str, tmp_path: Path) -> None:
    from migrations.migrate import upgrade

    upgrade(sqlite_url)
    journal = tmp_path / "journal"
    log = ConversationLog(sqlite_url, journal, fsync="always", segment_bytes=4096, flush_interval_s=0.01)
    await log.start()
    tenant = new_tenant()
    for _ in range(20):
        await log.record_completion(completion(tenant, tokens=50))
    assert await log.flush(10)
    await log.close()
    assert _stored(sqlite_url, tenant) == 20
    # Committed segments are deleted; only the last (the writer's) one may remain.
    assert len(list(journal.glob("segment-*.jsonl"))) == 1


async def test_replay_after_restart_and_torn_line(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from migrations.migrate import upgrade

    journal = tmp_path / "journal"
    tenant = new_tenant()
    # The database has no schema yet: records stay journaled.
    first = ConversationLog(sqlite_url, journal, retry_initial_s=0.01, retry_max_s=0.05)
    await first.start()
    for _ in range(5):
        await first.record_completion(completion(tenant, tokens=10))
    assert not await first.flush(0.3)
    # The flusher's first failed write marks the database unavailable (on a loaded machine it may not
    # have tried yet when the flush above gave up): wait for it rather than assume it.
    for _ in range(200):
        if not first.db_available:
            break
        await asyncio.sleep(0.05)
    assert first.backlog() == 5 and not first.db_available
    await first.close(timeout_s=0.1)

    [segment] = sorted(journal.glob("segment-*.jsonl"))
    with segment.open("ab") as file:
        file.write(b'C{"id":"chatcmpl-torn","tenant_id":')  # a crash mid-write
    upgrade(sqlite_url)
    for _ in range(2):  # replaying twice stores nothing twice
        second = ConversationLog(sqlite_url, journal)
        await second.start()
        assert await second.flush(10)
        await second.close()
        assert _stored(sqlite_url, tenant) == 5
    assert any("torn last line" in r.getMessage() for r in caplog.records if r.name == "tandem.log")


async def test_journal_is_locked_to_one_process(sqlite_url: str, tmp_path: Path) -> None:
    log = ConversationLog(sqlite_url, tmp_path / "journal")
    await log.start()
    other = ConversationLog(sqlite_url, tmp_path / "journal")
    with pytest.raises(RuntimeError, match="in use"):
        await other.start()
    await log.close(timeout_s=0.1)
    with pytest.raises(RuntimeError, match="not started"):
        await log.record_completion(completion(new_tenant()))
