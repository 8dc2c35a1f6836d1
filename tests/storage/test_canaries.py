"""Canaries on SQLite and PostgreSQL: one running per scope (the base's too), tallies per side, and
decisions that exactly one of several racing judges applies."""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict, replace
from datetime import timedelta

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage import get_adapter, record_adapter, set_adapter_status, write_records
from storage.canaries import (
    CanaryScope,
    Thumbs,
    arm_thumbs,
    decide_canary,
    get_canary,
    list_canaries,
    start_canary,
)
from storage.model_versions import get_version, record_model_version
from storage.models import Canary
from storage.times import utcnow
from tests.storage.factories import completion, feedback

RACERS = 8


def adapter(sessions: sessionmaker[Session], tenant: str, *, serving: bool = False) -> str:
    adapter_id = f"a-{uuid.uuid4().hex[:10]}"
    with sessions.begin() as session:
        record_adapter(
            session,
            adapter_id=adapter_id,
            model="m",
            tenant_id=tenant,
            scope_kind="tenant",
            scope=tenant,
            checkpoint_path=f"/adapters/{adapter_id}",
        )
        if serving:
            set_adapter_status(session, adapter_id=adapter_id, status="serving")
    return adapter_id


def canary(
    sessions: sessionmaker[Session], candidate_id: str, control_id: str | None, scope: CanaryScope | None = None
) -> tuple[str, str | None]:
    canary_id = f"cnr-{uuid.uuid4().hex[:12]}"
    now = utcnow()
    with sessions.begin() as session:
        if scope is None:
            candidate = get_adapter(session, adapter_id=candidate_id)
            scope = CanaryScope(candidate.model, candidate.tenant_id, candidate.scope_kind, candidate.scope)
        started, superseded = start_canary(
            session,
            canary_id=canary_id,
            scope=scope,
            candidate_id=candidate_id,
            control_id=control_id,
            share=0.25,
            rules={"min_ratings": 5},
            started_by="test",
            deadline=now + timedelta(hours=1),
            now=now,
        )
    assert started.status == "running" and started.share == 0.25
    return canary_id, superseded


def test_a_new_canary_supersedes_the_running_one_and_the_index_keeps_one(
    sessions: sessionmaker[Session], tenant: str
) -> None:
    control = adapter(sessions, tenant, serving=True)
    first, first_superseded = canary(sessions, adapter(sessions, tenant), control)
    second, superseded = canary(sessions, adapter(sessions, tenant), control)
    assert first_superseded is None and superseded == first
    with sessions() as session:
        ended = get_canary(session, canary_id=first)
        assert ended.status == "superseded" and "superseded by canary " + second in (ended.reason or "")
        assert get_adapter(session, adapter_id=ended.candidate_id).status == "candidate"
        assert [c.id for c in list_canaries(session, tenant_id=tenant, status="running")] == [second]
    # The partial unique index refuses a second running canary that skips start_canary.
    with pytest.raises(IntegrityError), sessions.begin() as session:
        running = asdict(get_canary(session, canary_id=second))
        session.add(Canary(**{**running, "id": f"cnr-{uuid.uuid4().hex[:12]}"}))


def test_each_side_counts_its_own_rated_answers(sessions: sessionmaker[Session], tenant: str) -> None:
    control = adapter(sessions, tenant, serving=True)
    canary_id, _ = canary(sessions, adapter(sessions, tenant), control)
    records = []
    for arm, scores in (("canary", [1.0, 1.0, -1.0, 0.0]), ("control", [-1.0, -1.0, 1.0])):
        for score in scores:
            rec = replace(completion(tenant, tokens=4), canary_id=canary_id, canary_arm=arm)
            records.append((rec, feedback(rec, score=score)))
    unrelated = completion(tenant, tokens=4)  # outside the split: counts for neither side
    with sessions.begin() as session:
        write_records(session, [r for r, _ in records] + [unrelated], [f for _, f in records])
        write_records(session, [], [feedback(unrelated, score=1.0)])
    with sessions() as session:
        # A zero score is neither up nor down.
        assert arm_thumbs(session, canary_id=canary_id) == {"canary": Thumbs(2, 1), "control": Thumbs(1, 2)}


@pytest.mark.parametrize("decision", ["promoted", "rolled_back"])
def test_exactly_one_racing_judge_decides_and_the_candidate_follows(
    sessions: sessionmaker[Session], tenant: str, decision: str
) -> None:
    control = adapter(sessions, tenant, serving=True)
    candidate = adapter(sessions, tenant)
    canary_id, _ = canary(sessions, candidate, control)
    barrier, wins = threading.Barrier(RACERS), []

    def judge(index: int) -> None:
        barrier.wait()
        with sessions.begin() as session:
            if decide_canary(
                session,
                canary_id=canary_id,
                decision=decision,  # type: ignore[arg-type]
                reason=f"judge {index}",
                numbers={"judge": index},
                decided_by=f"judge-{index}",
            ):
                wins.append(index)

    threads = [threading.Thread(target=judge, args=(i,)) for i in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1
    with sessions() as session:
        decided = get_canary(session, canary_id=canary_id)
        assert (decided.status, decided.decided_by, decided.numbers) == (
            decision,
            f"judge-{wins[0]}",
            {"judge": wins[0]},
        )
        statuses = get_adapter(session, adapter_id=candidate).status, get_adapter(session, adapter_id=control).status
    assert statuses == (("serving", "retired") if decision == "promoted" else ("rejected", "serving"))


def version(sessions: sessionmaker[Session], model: str) -> str:
    version_id = f"v-{uuid.uuid4().hex[:10]}"
    with sessions.begin() as session:
        record_model_version(session, version_id=version_id, model=model, checkpoint_path=f"/ckpt/{version_id}")
    return version_id


def test_one_base_canary_per_model_and_a_rollback_rejects_the_version(
    sessions: sessionmaker[Session], tenant: str
) -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"
    base = CanaryScope.base(model)
    first, _ = canary(sessions, version(sessions, model), None, base)
    candidate = version(sessions, model)
    second, superseded = canary(sessions, candidate, None, base)
    assert superseded == first
    with pytest.raises(IntegrityError), sessions.begin() as session:  # tenant NULL: its own index
        running = asdict(get_canary(session, canary_id=second))
        session.add(Canary(**{**running, "id": f"cnr-{uuid.uuid4().hex[:12]}"}))
    with pytest.raises(IntegrityError), sessions.begin() as session:  # a base canary spans every tenant
        session.add(
            Canary(**{**running, "id": f"cnr-{uuid.uuid4().hex[:12]}", "status": "superseded", "tenant_id": tenant})
        )
    with sessions.begin() as session:
        assert decide_canary(
            session, canary_id=second, decision="rolled_back", reason="worse", numbers={}, decided_by="test"
        )
    with sessions() as session:
        rejected = get_version(session, version_id=candidate)
        assert rejected.status == "rejected" and rejected.status_reason == "canary: worse"
        assert [c.tenant_id for c in list_canaries(session, model=model)] == [None, None]
