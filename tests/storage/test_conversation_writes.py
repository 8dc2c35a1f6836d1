from __future__ import annotations

from array import array
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, func, select

from storage.completions import completion_tenant, get_completion_view
from storage.conversation_writes import write_records
from storage.db import make_engine, make_session_factory
from storage.models import Completion, ConversationSession, FeedbackEvent
from tests.storage.factories import completion, feedback, new_tenant


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _write(engine: Engine, completions: list, feedback_events: list) -> None:  # type: ignore[type-arg]
    with make_session_factory(engine).begin() as session:
        write_records(session, completions, feedback_events)


def test_completion_round_trip(engine: Engine) -> None:
    tenant = new_tenant()
    rec = completion(tenant, end_user="alice", seed=1)
    _write(engine, [rec], [])
    with make_session_factory(engine)() as session:
        assert completion_tenant(session, rec.id) == tenant
        assert get_completion_view(session, tenant_id="someone-else", completion_id=rec.id) is None
        view = get_completion_view(session, tenant_id=tenant, completion_id=rec.id)
    assert view is not None
    assert view.prompt_token_ids == rec.prompt_token_ids
    assert view.request_messages == rec.request_messages and view.metadata == rec.metadata
    assert view.end_user == "alice" and view.session_key is None and view.turn_index is None
    [choice] = view.choices
    assert choice.token_ids == rec.choices[0].token_ids
    assert choice.logprobs == array("f", rec.choices[0].logprobs).tolist()
    assert choice.weight_versions == tuple(rec.choices[0].weight_versions)
    assert choice.feedback is None
    assert view.created_at.tzinfo is not None and view.created_at.timestamp() == pytest.approx(rec.created_at)


def test_replay_is_idempotent(engine: Engine) -> None:
    tenant = new_tenant()
    recs = [completion(tenant, tokens=5, session_key="s1") for _ in range(3)]
    fb = feedback(recs[0], score=1.0, rating="up")
    _write(engine, recs, [fb])
    _write(engine, recs, [fb])
    _write(engine, recs[:1] + recs[:1], [fb, fb])
    with make_session_factory(engine)() as session:
        count = session.scalar(select(func.count()).select_from(Completion).where(Completion.tenant_id == tenant))
        conversation = session.scalars(select(ConversationSession).where(ConversationSession.tenant_id == tenant)).one()
        view = get_completion_view(session, tenant_id=tenant, completion_id=recs[0].id)
    assert count == 3
    assert conversation.turn_count == 3
    assert view is not None and view.choices[0].feedback is not None
    assert view.choices[0].feedback.revision == 1 and len(view.choices[0].feedback.history) == 1


def test_session_turns_link_in_created_order(engine: Engine) -> None:
    tenant = new_tenant()
    first, second, third = (
        completion(tenant, tokens=2, session_key="chat", end_user="bob", created_at=100.0 + i) for i in range(3)
    )
    _write(engine, [second, first], [])  # out of order within a batch
    _write(engine, [third], [])
    with make_session_factory(engine)() as session:
        views = [get_completion_view(session, tenant_id=tenant, completion_id=r.id) for r in (first, second, third)]
        conversation = session.scalars(select(ConversationSession).where(ConversationSession.tenant_id == tenant)).one()
    assert [(v.turn_index, v.previous_completion_id) for v in views if v] == [
        (0, None),
        (1, first.id),
        (2, second.id),
    ]
    assert {v.session_key for v in views if v} == {"chat"}
    assert conversation.turn_count == 3 and conversation.last_completion_id == third.id
    assert conversation.end_user_id is not None


def test_feedback_history_and_current(engine: Engine) -> None:
    tenant = new_tenant()
    rec = completion(tenant, tokens=3)
    events = [
        feedback(rec, score=s, rating=r, created_at=200.0 + i)
        for i, (s, r) in enumerate([(1.0, "up"), (-1.0, "down"), (0.5, None)])
    ]
    _write(engine, [rec], events[:2])  # feedback in the same batch as its completion
    _write(engine, [], events[2:])
    with make_session_factory(engine)() as session:
        view = get_completion_view(session, tenant_id=tenant, completion_id=rec.id)
    assert view is not None
    current = view.choices[0].feedback
    assert current is not None
    assert (current.score, current.rating, current.revision) == (0.5, None, 3)
    assert [e.id for e in current.history] == [e.id for e in events]
    assert current.created_at.timestamp() == 200.0 and current.updated_at.timestamp() == 202.0


def test_orphan_feedback_and_unknown_key_do_not_block(engine: Engine) -> None:
    tenant = new_tenant()
    rec = completion(tenant, tokens=2)
    rec.api_key_id = "key_that_does_not_exist"
    orphan = feedback(completion(tenant), score=1.0)
    _write(engine, [rec], [orphan])
    with make_session_factory(engine)() as session:
        stored = session.get(Completion, rec.id)
        orphan_rows = session.scalar(
            select(func.count()).select_from(FeedbackEvent).where(FeedbackEvent.id == orphan.id)
        )
    assert stored is not None and stored.api_key_id is None
    assert orphan_rows == 0


NUL_TEXT = "a\x00b \uffff0 \uffff1 \uffff\x00 end\x00"  # NUL, the escape mark and text that looks escaped


def test_text_with_nul_characters_is_stored_and_read_back_unchanged(engine: Engine) -> None:
    """PostgreSQL refuses U+0000 in text and JSONB; the record must still be stored exactly, not set aside."""
    tenant = new_tenant()
    rec = completion(tenant, end_user=f"user{NUL_TEXT}", session_key=f"chat{NUL_TEXT}", seed=2)
    rec.request_messages = [{"role": "user", "content": NUL_TEXT, NUL_TEXT: [NUL_TEXT, 1, None]}]
    rec.metadata = {"note": NUL_TEXT}
    rec.choices[0].text = NUL_TEXT
    event = feedback(rec, score=1.0, rating="up")
    event.comment, event.corrected_answer = NUL_TEXT, NUL_TEXT
    _write(engine, [rec], [event])
    with make_session_factory(engine)() as session:
        view = get_completion_view(session, tenant_id=tenant, completion_id=rec.id)
        conversation = session.scalars(select(ConversationSession).where(ConversationSession.tenant_id == tenant)).one()
    assert view is not None
    assert view.request_messages == rec.request_messages and view.metadata == rec.metadata
    assert (view.end_user, view.session_key) == (f"user{NUL_TEXT}", f"chat{NUL_TEXT}")
    assert view.choices[0].text == NUL_TEXT and conversation.session_key == f"chat{NUL_TEXT}"
    current = view.choices[0].feedback
    assert current is not None and (current.comment, current.corrected_answer) == (NUL_TEXT, NUL_TEXT)
    assert current.history[0].comment == NUL_TEXT
