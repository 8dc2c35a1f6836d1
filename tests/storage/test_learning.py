from __future__ import annotations

import threading
import time
import uuid
from array import array
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.exc import IntegrityError

from learner.collect import feedback_samples
from learner.sample import SampleStatus
from migrations.migrate import upgrade
from storage import (
    FeedbackBatch,
    LearningStateError,
    NotFoundError,
    RoundBusyError,
    cancel_round,
    collect_feedback,
    fail_stale_rounds,
    finish_round,
    get_round,
    heartbeat_round,
    last_watermark,
    list_rounds,
    list_versions,
    queue_round,
    record_model_version,
    serving_version,
    set_version_status,
    start_round,
)
from storage.conversation_writes import write_records
from storage.db import make_engine, make_session_factory
from storage.models import ModelVersion
from storage.records import CompletionRecord, FeedbackRecord
from storage.times import utcnow
from tests.storage.factories import completion, feedback, new_tenant


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _model() -> str:
    # Each test its own model: the PostgreSQL database is shared by the whole test session.
    return f"m-{uuid.uuid4().hex[:12]}"


def _completion(tenant: str, model: str, **kwargs: object) -> CompletionRecord:
    rec = completion(tenant, tokens=6, **kwargs)  # type: ignore[arg-type]
    rec.model = model
    return rec


def _write(engine: Engine, completions: list[CompletionRecord], events: list[FeedbackRecord]) -> None:
    with make_session_factory(engine).begin() as session:
        write_records(session, completions, events)


def _collect(engine: Engine, model: str, since: int, **filters: object) -> FeedbackBatch:
    with make_session_factory(engine)() as session:
        return collect_feedback(session, model=model, since=since, **filters)  # type: ignore[arg-type]


def _keys(batch: FeedbackBatch) -> list[tuple[str, int]]:
    return [(item.completion_id, item.revision) for item in batch.items]


def _run_round(engine: Engine, model: str) -> FeedbackBatch:
    """What a learner round does with storage: start, collect from the watermark, succeed."""
    with make_session_factory(engine).begin() as session:
        round_ = start_round(session, model=model, worker_id="w1")
    batch = _collect(engine, model, round_.watermark_from or 0)
    with make_session_factory(engine).begin() as session:
        finish_round(
            session,
            round_id=round_.id,
            status="succeeded",
            watermark_to=batch.watermark,
            samples_collected=len(batch.items),
        )
    return batch


def test_collect_round_trip_and_samples(engine: Engine) -> None:
    tenant, model = new_tenant(), _model()
    rec = _completion(tenant, model, end_user="alice", session_key="chat-1", seed=3)
    unrated = _completion(tenant, model)
    other_model = _completion(tenant, _model())
    _write(engine, [rec, unrated, other_model], [feedback(rec, score=1.0, rating="up"), feedback(other_model, score=1)])

    batch = _collect(engine, model, 0)
    [item] = batch.items
    assert batch.since == 0 and batch.watermark >= item.seq > 0
    assert (item.completion_id, item.choice_index, item.tenant_id, item.model) == (rec.id, 0, tenant, model)
    assert (item.user_id, item.session_id) == ("alice", "chat-1")
    assert item.prompt_token_ids == rec.prompt_token_ids
    assert item.response_token_ids == rec.choices[0].token_ids
    assert item.rollout_log_probs == array("f", rec.choices[0].logprobs).tolist()
    assert item.weight_versions == tuple(rec.choices[0].weight_versions)
    assert (item.score, item.rating, item.revision, item.corrected_answer) == (1.0, "up", 1, None)
    assert item.request_messages == rec.request_messages and item.response_text == "four"
    assert _collect(engine, model, batch.watermark).items == ()

    [sample] = feedback_samples(batch.items)
    assert sample.prompt_token_ids == rec.prompt_token_ids and sample.response_token_ids == item.response_token_ids
    assert sample.rollout_log_probs == item.rollout_log_probs and sample.weight_versions == ["v1", "v2"]
    assert (sample.user_id, sample.session_id, sample.completion_id) == ("alice", "chat-1", rec.id)
    assert sample.status is SampleStatus.COMPLETED and sample.reward is None and sample.group_index == 0
    assert sample.metadata["feedback"]["rating"] == "up" and sample.metadata["choice_index"] == 0


def test_late_feedback_with_an_older_timestamp_is_collected_by_the_next_round(engine: Engine) -> None:
    tenant, model = new_tenant(), _model()
    early, late = _completion(tenant, model), _completion(tenant, model)
    now = time.time()
    _write(engine, [early, late], [feedback(early, score=1.0, created_at=now)])
    first = _run_round(engine, model)
    assert _keys(first) == [(early.id, 1)]

    # A journal replay from a gateway whose clock is an hour behind: stamped before the round ran.
    _write(engine, [], [feedback(late, score=-1.0, created_at=now - 3600)])
    second = _run_round(engine, model)
    assert _keys(second) == [(late.id, 1)]
    assert second.items[0].rated_at < first.items[0].rated_at  # a timestamp cut would have skipped it
    assert _run_round(engine, model).items == ()


def test_a_changed_rating_is_new_data_and_nothing_else_is_collected_twice(engine: Engine) -> None:
    tenant, model = new_tenant(), _model()
    a, b = _completion(tenant, model), _completion(tenant, model)
    up = feedback(a, score=1.0, rating="up")
    _write(engine, [a, b], [up, feedback(b, score=0.5)])
    assert sorted(_keys(_run_round(engine, model))) == sorted([(a.id, 1), (b.id, 1)])

    _write(engine, [], [up])  # a replayed event changes nothing, so it is not collected again
    assert _run_round(engine, model).items == ()

    _write(engine, [], [feedback(a, score=-1.0, rating="down")])
    [changed] = _run_round(engine, model).items
    assert (changed.completion_id, changed.revision, changed.rating) == (a.id, 2, "down")
    assert _run_round(engine, model).items == ()


def test_filters_and_limit(engine: Engine) -> None:
    tenant, other_tenant, model = new_tenant(), new_tenant(), _model()
    mine = [_completion(tenant, model, end_user="bob") for _ in range(3)]
    theirs = _completion(other_tenant, model, end_user="bob")
    old = _completion(tenant, model, created_at=time.time() - 7200)
    _write(engine, [*mine, theirs, old], [feedback(rec, score=1.0) for rec in [*mine, theirs, old]])

    assert {i.completion_id for i in _collect(engine, model, 0, tenant_id=tenant).items} == {
        *(r.id for r in mine),
        old.id,
    }
    assert {i.tenant_id for i in _collect(engine, model, 0, end_user="bob").items} == {tenant, other_tenant}
    recent = _collect(engine, model, 0, tenant_id=tenant, max_age=timedelta(hours=1))
    assert {i.completion_id for i in recent.items} == {r.id for r in mine}

    page = _collect(engine, model, 0, limit=2)
    assert len(page.items) == 2 and page.watermark == page.items[-1].seq
    rest = _collect(engine, model, page.watermark)
    assert len(rest.items) == 3 and not {i.completion_id for i in rest.items} & {i.completion_id for i in page.items}


def test_round_lifecycle(engine: Engine) -> None:
    model = _model()
    factory = make_session_factory(engine)
    with factory.begin() as session:
        assert last_watermark(session, model=model) == 0
        queued = queue_round(session, model=model, trigger="schedule", config={"lr": 1e-6})
        started = start_round(session, model=model, worker_id="w1", round_id=queued.id)
        assert (started.status, started.trigger, started.worker_id, started.watermark_from) == (
            "running",
            "schedule",
            "w1",
            0,
        )
        assert started.config == {"lr": 1e-6} and started.heartbeat_at is not None
        with pytest.raises(RoundBusyError):
            start_round(session, model=model, worker_id="w2")
        with pytest.raises(LearningStateError):
            start_round(session, model=model, worker_id="w2", round_id=queued.id)
        assert heartbeat_round(session, round_id=started.id)
        with pytest.raises(ValueError):
            finish_round(session, round_id=started.id, status="succeeded")
        done = finish_round(
            session,
            round_id=started.id,
            status="succeeded",
            watermark_to=42,
            metrics={"loss": 0.5},
            samples_collected=7,
            samples_trained=6,
        )
        assert (done.status, done.watermark_to, done.metrics, done.samples_trained) == (
            "succeeded",
            42,
            {"loss": 0.5},
            6,
        )
        assert done.finished_at is not None and not heartbeat_round(session, round_id=started.id)
        with pytest.raises(LearningStateError):
            finish_round(session, round_id=started.id, status="failed", error="late")

        failed = start_round(session, model=model, worker_id="w2")
        assert failed.watermark_from == 42
        failed = finish_round(session, round_id=failed.id, status="failed", error="OOM", watermark_to=99)
        assert failed.error == "OOM" and last_watermark(session, model=model) == 42  # only success moves it
        idle = start_round(session, model=model, worker_id="w3")
        with pytest.raises(ValueError, match="needs the reason"):
            finish_round(session, round_id=idle.id, status="nothing_to_learn", watermark_to=50)
        idle = finish_round(
            session, round_id=idle.id, status="nothing_to_learn", watermark_to=50, reason="every advantage is zero"
        )
        assert (idle.status, idle.reason, idle.produced_version_id) == (
            "nothing_to_learn",
            "every advantage is zero",
            None,
        )
        assert last_watermark(session, model=model) == 50  # its data was consumed: the next round starts after it
        cancelled = cancel_round(session, round_id=queue_round(session, model=model, trigger="manual").id)
        assert cancelled.status == "cancelled"
        assert [r.id for r in list_rounds(session, model=model)] == [cancelled.id, idle.id, failed.id, started.id]
        assert [r.id for r in list_rounds(session, model=model, status="failed")] == [failed.id]
        with pytest.raises(NotFoundError):
            get_round(session, round_id="nope")


def test_stale_rounds_are_failed_and_rerun_from_the_same_watermark(engine: Engine) -> None:
    model = _model()
    t0 = utcnow()
    with make_session_factory(engine).begin() as session:
        dead = start_round(session, model=model, worker_id="w1", now=t0)
        assert fail_stale_rounds(session, timeout=timedelta(seconds=60), now=t0 + timedelta(seconds=30)) == ()
        assert heartbeat_round(session, round_id=dead.id, now=t0 + timedelta(seconds=50))
        assert fail_stale_rounds(session, timeout=timedelta(seconds=60), now=t0 + timedelta(seconds=100)) == ()
        [failed] = fail_stale_rounds(session, timeout=timedelta(seconds=60), now=t0 + timedelta(seconds=200))
        assert (failed.id, failed.status) == (dead.id, "failed") and "heart" in (failed.error or "")
        # The zombie worker wakes up: it may not move the watermark under the re-run.
        with pytest.raises(LearningStateError):
            finish_round(session, round_id=dead.id, status="succeeded", watermark_to=10)
        assert not heartbeat_round(session, round_id=dead.id)
        rerun = start_round(session, model=model, worker_id="w2")  # the lock was released
        assert rerun.watermark_from == dead.watermark_from == 0


def _versions(engine: Engine, model: str, count: int) -> list[str]:
    ids = [f"{model}-v{i}" for i in range(count)]
    with make_session_factory(engine).begin() as session:
        for i, version_id in enumerate(ids):
            record_model_version(
                session,
                version_id=version_id,
                model=model,
                checkpoint_path=f"/ckpt/{version_id}",
                sha256="ab" * 32,
                parent_id=ids[i - 1] if i else None,
                watermark=i * 10,
                metrics={"reward": i},
                evaluation={},
            )
    return ids


def test_promote_and_rollback_keep_one_serving_version(engine: Engine) -> None:
    model = _model()
    v0, v1, v2 = _versions(engine, model, 3)
    with make_session_factory(engine).begin() as session:
        assert serving_version(session, model=model) is None
        assert [v.id for v in list_versions(session, model=model, status="candidate")] and {
            v.status for v in list_versions(session, model=model)
        } == {"candidate"}
        assert set_version_status(session, version_id=v0, status="serving").promoted_at is not None
        promoted = set_version_status(session, version_id=v1, status="serving", evaluation={"reward": 0.7})
        assert promoted.evaluation == {"reward": 0.7} and promoted.parent_id == v0 and promoted.watermark == 10
        assert {v.id: v.status for v in list_versions(session, model=model)} == {
            v0: "retired",
            v1: "serving",
            v2: "candidate",
        }
        rejected = set_version_status(session, version_id=v2, status="rejected", reason="worse by 0.1")
        assert rejected.status_reason == "worse by 0.1"
        rolled_back = set_version_status(session, version_id=v0, status="serving")  # a rollback
        assert rolled_back.retired_at is None
        serving = serving_version(session, model=model)
        assert serving is not None and serving.id == v0
        assert [v.id for v in list_versions(session, model=model, status="serving")] == [v0]
        with pytest.raises(NotFoundError):
            set_version_status(session, version_id="nope", status="serving")
    # The unique partial index backs the rule even for writers that bypass set_version_status.
    with pytest.raises(IntegrityError), make_session_factory(engine).begin() as session:
        session.execute(update(ModelVersion).where(ModelVersion.id == v1).values(status="serving"))


@pytest.mark.postgres
def test_concurrent_promotions_leave_one_serving_version(postgres_url: str) -> None:
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    try:
        model = _model()
        v0, v1, v2 = _versions(engine, model, 3)
        factory = make_session_factory(engine)
        with factory.begin() as session:
            set_version_status(session, version_id=v0, status="serving")
        errors: list[BaseException] = []

        def promote_v2() -> None:
            try:
                with factory.begin() as other:
                    set_version_status(other, version_id=v2, status="serving")
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        with factory.begin() as first:
            set_version_status(first, version_id=v1, status="serving")
            second = threading.Thread(target=promote_v2)
            second.start()
            second.join(timeout=0.5)
            assert second.is_alive()  # waits for the first promotion's row locks
        second.join(timeout=10)
        assert not errors
        with factory() as session:
            assert {v.id: v.status for v in list_versions(session, model=model)} == {
                v0: "retired",
                v1: "retired",
                v2: "serving",
            }
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_collect_waits_for_feedback_writers_that_commit_out_of_order(postgres_url: str) -> None:
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    try:
        tenant, model = new_tenant(), _model()
        slow, fast = _completion(tenant, model), _completion(tenant, model)
        _write(engine, [slow, fast], [])
        factory = make_session_factory(engine)
        batches: list[FeedbackBatch] = []
        with factory.begin() as writer:
            write_records(writer, [], [feedback(slow, score=1.0)])  # takes the lower number, commits last
            _write(engine, [], [feedback(fast, score=1.0)])
            collector = threading.Thread(target=lambda: batches.append(_collect(engine, model, 0)))
            collector.start()
            collector.join(timeout=0.5)
            assert collector.is_alive()  # the bound waits for the writer in flight
        collector.join(timeout=10)
        [batch] = batches
        assert {item.completion_id for item in batch.items} == {slow.id, fast.id}
    finally:
        engine.dispose()
