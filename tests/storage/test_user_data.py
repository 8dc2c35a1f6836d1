"""A user's data exported and deleted, on SQLite and PostgreSQL: after the deletion no learner read
(collect, baselines, the due count) sees it, and the journal cannot bring it back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from server.conversation_log import ConversationLog
from storage import NotFoundError, collect_feedback, count_feedback_since, last_watermark, rating_history
from storage.conversation_writes import write_records
from storage.data_deletions import DeletionView, list_deletions
from storage.db import make_engine, make_session_factory
from storage.models import Completion, FeedbackChange
from storage.records import CompletionRecord
from storage.user_data import UserData, delete_user_data, export_user_data
from tests.storage.factories import feedback, new_tenant
from tests.storage.test_learning import _completion, _model, _run_round, _write

ACTOR = "admin:test"


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@dataclass
class Traffic:
    """alice: a1 and a2 (a2 names nobody) in her session, a3 outside any session; bob: b1 in his own
    session and b2 in alice's. Ratings on a1 (twice), a3, b1, b2."""

    tenant: str
    model: str
    a1: CompletionRecord
    a2: CompletionRecord
    a3: CompletionRecord
    b1: CompletionRecord
    b2: CompletionRecord


def _traffic(engine: Engine) -> Traffic:
    tenant, model = new_tenant(), _model()
    start = time.time() - 60
    a1 = _completion(tenant, model, end_user="alice", session_key="s-alice", created_at=start, seed=1)
    a2 = _completion(tenant, model, session_key="s-alice", created_at=start + 1)
    a3 = _completion(tenant, model, end_user="alice", created_at=start + 2)
    b1 = _completion(tenant, model, end_user="bob", session_key="s-bob", created_at=start + 3)
    b2 = _completion(tenant, model, end_user="bob", session_key="s-alice", created_at=start + 4)
    elsewhere = _completion(new_tenant(), _model(), end_user="alice")  # another tenant's alice
    ratings = [feedback(a1, score=1.0, rating="up"), feedback(a1, score=-1.0, rating="down")]
    ratings += [feedback(rec, score=0.5) for rec in (a3, b1, b2, elsewhere)]
    _write(engine, [a1, a2, a3, b1, b2, elsewhere], ratings)
    return Traffic(tenant, model, a1, a2, a3, b1, b2)


def _export(engine: Engine, tenant: str, user: str) -> UserData:
    with make_session_factory(engine)() as session:
        return export_user_data(session, tenant_id=tenant, end_user=user)


def _delete(engine: Engine, tenant: str, user: str) -> DeletionView:
    with make_session_factory(engine).begin() as session:
        return delete_user_data(session, tenant_id=tenant, end_user=user, actor=ACTOR)


def _stored_ids(engine: Engine, tenant: str) -> set[str]:
    with make_session_factory(engine)() as session:
        return set(session.scalars(select(Completion.id).where(Completion.tenant_id == tenant)))


def _changes_of(engine: Engine, completion_ids: list[str]) -> int:
    query = select(func.count()).select_from(FeedbackChange).where(FeedbackChange.completion_id.in_(completion_ids))
    with make_session_factory(engine)() as session:
        return int(session.scalar(query) or 0)


def test_export_holds_everything_stored_about_the_user(engine: Engine) -> None:
    t = _traffic(engine)
    data = _export(engine, t.tenant, "alice")

    assert (data.tenant_id, data.end_user, data.deletions) == (t.tenant, "alice", ())
    assert [(s.session_key, s.turn_count) for s in data.sessions] == [("s-alice", 3)]  # bob's b2 is a turn of it
    assert [c.id for c in data.completions] == [t.a1.id, t.a2.id, t.a3.id]
    first = data.completions[0]
    assert (first.end_user, first.session_key, first.turn_index) == ("alice", "s-alice", 0)
    assert first.request_messages == t.a1.request_messages and first.prompt_token_ids == t.a1.prompt_token_ids
    choice = first.choices[0]
    assert (choice.text, choice.token_ids) == (t.a1.choices[0].text, t.a1.choices[0].token_ids)
    assert choice.feedback is not None and (choice.feedback.rating, choice.feedback.revision) == ("down", 2)
    assert [event.rating for event in choice.feedback.history] == ["up", "down"]
    assert data.completions[1].end_user is None and data.completions[1].choices[0].feedback is None
    assert data.completions[2].session_key is None

    bob = _export(engine, t.tenant, "bob")
    assert [c.id for c in bob.completions] == [t.b1.id, t.b2.id]  # b2 is his, in alice's session
    for tenant, user in ((t.tenant, "carol"), (new_tenant(), "alice")):
        with pytest.raises(NotFoundError):
            _export(engine, tenant, user)


def test_deleted_data_never_reaches_a_later_round(engine: Engine) -> None:
    t = _traffic(engine)
    alice = [t.a1.id, t.a2.id, t.a3.id]
    first = _run_round(engine, t.model)
    assert {item.user_id for item in first.items} == {"alice", "bob"}
    _write(engine, [], [feedback(t.a1, score=1.0, rating="up"), feedback(t.b1, score=1.0, rating="up")])
    with make_session_factory(engine)() as session:
        assert count_feedback_since(session, model=t.model, since=first.watermark) == 2
    changes = _changes_of(engine, alice)
    assert changes >= 3  # a1's insert and two updates' worth (batched events may share one), a3's insert

    deletion = _delete(engine, t.tenant, "alice")

    assert deletion.counts == {
        "feedback_changes": changes,
        "feedback_events": 4,
        "feedback": 2,
        "completion_choices": 3,
        "completions": 3,
        "sessions": 1,
        "end_users": 1,
        "canaries": 0,
        "adapters": 0,
        "cohort_members": 0,
    }
    assert (deletion.tenant_id, deletion.end_user, deletion.actor) == (t.tenant, "alice", ACTOR)
    with make_session_factory(engine)() as session:
        assert count_feedback_since(session, model=t.model, since=first.watermark) == 1
        assert {r.user_id for r in rating_history(session, model=t.model)} == {"bob"}
        history = collect_feedback(session, model=t.model, since=0)
        assert list_deletions(session, tenant_id=t.tenant, end_user="alice") == [deletion]
    assert {item.user_id for item in history.items} == {"bob"}
    later = _run_round(engine, t.model)
    assert [(item.completion_id, item.user_id) for item in later.items] == [(t.b1.id, "bob")]
    assert _changes_of(engine, alice) == 0
    assert _stored_ids(engine, t.tenant) == {t.b1.id, t.b2.id}
    bob = _export(engine, t.tenant, "bob")
    assert [c.session_key for c in bob.completions] == ["s-bob", None]  # b2 lost only its deleted session
    with pytest.raises(NotFoundError):
        _export(engine, t.tenant, "alice")
    with pytest.raises(NotFoundError):
        _delete(engine, t.tenant, "alice")  # deleted already


async def test_journal_replay_after_the_deletion_drops_the_users_older_records(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    tenant, model = new_tenant(), _model()
    stored = _completion(tenant, model, end_user="alice")
    _write(engine, [stored], [])
    # A gateway journals while its database is away: the records wait in the journal.
    down = ConversationLog(f"sqlite:///{tmp_path / 'missing' / 'tandem.db'}", tmp_path / "journal", retry_max_s=0.1)
    await down.start()
    journaled = _completion(tenant, model, end_user="alice")
    bob = _completion(tenant, model, end_user="bob")
    for rec in (journaled, bob):
        await down.record_completion(rec)
    for rec in (journaled, stored, bob):
        await down.record_feedback(feedback(rec, score=1.0, rating="up"))
    await down.close(timeout_s=0.2)
    assert down.backlog() == 5

    assert _delete(engine, tenant, "alice").counts["completions"] == 1
    time.sleep(0.01)  # the next request starts after the deletion even on a coarse clock
    back = _completion(tenant, model, end_user="alice")  # alice comes back after her deletion

    log = ConversationLog(database_url, tmp_path / "journal", flush_interval_s=0.01)
    await log.start()
    try:
        await log.record_completion(back)
        await log.record_feedback(feedback(back, score=-1.0, rating="down"))
        assert await log.flush(20)
    finally:
        await log.close()

    assert _stored_ids(engine, tenant) == {bob.id, back.id}
    with make_session_factory(engine)() as session:
        items = collect_feedback(session, model=model, since=0).items
    assert [(item.completion_id, item.user_id) for item in items] == [(bob.id, "bob"), (back.id, "alice")]
    assert [c.id for c in _export(engine, tenant, "alice").completions] == [back.id]


@pytest.mark.parametrize("first", ["journal write", "deletion"])
def test_a_deletion_and_a_journal_write_at_once(engine: Engine, first: str) -> None:
    """Whichever transaction runs second waits for the first, then sees what it did."""
    tenant, model = new_tenant(), _model()
    _write(engine, [_completion(tenant, model, end_user="alice")], [])
    late = _completion(tenant, model, end_user="alice", created_at=time.time() - 1)
    factory = make_session_factory(engine)

    def write() -> None:
        _write(engine, [late], [feedback(late, score=1.0)])

    def delete() -> None:
        counts.append(_delete(engine, tenant, "alice").counts["completions"])

    counts: list[int] = []
    with factory.begin() as session:
        if first == "deletion":
            counts.append(
                delete_user_data(session, tenant_id=tenant, end_user="alice", actor=ACTOR).counts["completions"]
            )
            second = threading.Thread(target=write)
        else:
            write_records(session, [late], [feedback(late, score=1.0)])  # holds until this block commits
            second = threading.Thread(target=delete)
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second transaction must wait for the first"
    second.join(10)

    assert not second.is_alive()
    assert counts == ([1] if first == "deletion" else [2])  # written first, the late record went with the rest
    assert _stored_ids(engine, tenant) == set()
    with factory() as session:
        assert collect_feedback(session, model=model, since=last_watermark(session, model=model)).items == ()
