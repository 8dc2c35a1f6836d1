"""Adapters per scope and cohorts, on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage import (
    NotFoundError,
    cohorts,
    delete_user_adapters,
    get_adapter,
    list_adapters,
    record_adapter,
    reset_scope,
    serving_adapter,
    set_adapter_status,
    set_cohort,
)
from storage.models import Adapter


def add(sessions: sessionmaker[Session], tenant: str, scope: str, kind: str = "user", model: str = "m") -> str:
    adapter_id = f"a-{uuid.uuid4().hex[:10]}"
    with sessions.begin() as session:
        record_adapter(
            session,
            adapter_id=adapter_id,
            model=model,
            tenant_id=tenant,
            scope_kind=kind,  # type: ignore[arg-type]
            scope=scope,
            checkpoint_path=f"/adapters/{adapter_id}",
            ratings=3,
        )
    return adapter_id


def promote(sessions: sessionmaker[Session], adapter_id: str) -> None:
    with sessions.begin() as session:
        set_adapter_status(session, adapter_id=adapter_id, status="serving")


def test_one_serving_adapter_per_scope_and_scopes_are_independent(sessions: sessionmaker[Session], tenant: str) -> None:
    first, second, other = add(sessions, tenant, "ann"), add(sessions, tenant, "ann"), add(sessions, tenant, "bob")
    cohort = add(sessions, tenant, "ann", kind="cohort")  # a cohort named like a user is another scope
    for adapter_id in (first, other, cohort, second):
        promote(sessions, adapter_id)
    with sessions() as session:
        assert get_adapter(session, adapter_id=first).status == "retired"
        assert serving_adapter(session, model="m", tenant_id=tenant, scope_kind="user", scope="ann").id == second  # type: ignore[union-attr]
        assert {a.id for a in list_adapters(session, tenant_id=tenant, status="serving")} == {second, other, cohort}
        assert [a.id for a in list_adapters(session, tenant_id=tenant, scope="ann", scope_kind="user")] == [
            second,
            first,
        ]
    promote(sessions, first)  # a rollback
    with sessions.begin() as session:
        assert get_adapter(session, adapter_id=second).status == "retired"
        assert reset_scope(session, model="m", tenant_id=tenant, scope_kind="user", scope="ann") == first
        assert serving_adapter(session, model="m", tenant_id=tenant, scope_kind="user", scope="ann") is None
        with pytest.raises(NotFoundError):
            set_adapter_status(session, adapter_id="a-unknown", status="serving")


def test_the_database_refuses_two_serving_adapters_for_one_scope(sessions: sessionmaker[Session], tenant: str) -> None:
    first, second = add(sessions, tenant, "ann"), add(sessions, tenant, "ann")
    promote(sessions, first)
    with pytest.raises(IntegrityError), sessions.begin() as session:
        session.query(Adapter).filter(Adapter.id == second).update({"status": "serving"})


def test_deleting_a_user_removes_only_their_adapters(sessions: sessionmaker[Session], tenant: str) -> None:
    mine, theirs, cohort = (
        add(sessions, tenant, "ann"),
        add(sessions, tenant, "bob"),
        add(sessions, tenant, "ann", "cohort"),
    )
    child = add(sessions, tenant, "ann")
    with sessions.begin() as session:
        session.query(Adapter).filter(Adapter.id == child).update({"parent_id": mine})
        assert sorted(delete_user_adapters(session, tenant_id=tenant, end_user="ann")) == sorted(
            [f"/adapters/{mine}", f"/adapters/{child}"]
        )
    with sessions() as session:
        assert {a.id for a in list_adapters(session, tenant_id=tenant)} == {theirs, cohort}


def test_cohort_membership_is_replaced_whole_and_a_user_is_in_one_cohort(
    sessions: sessionmaker[Session], tenant: str
) -> None:
    with sessions.begin() as session:
        assert set_cohort(session, tenant_id=tenant, cohort="terse", users=["b", "a", "a"]) == ["a", "b"]
        set_cohort(session, tenant_id=tenant, cohort="verbose", users=["b", "c"])
    with sessions.begin() as session:
        assert cohorts(session, tenant_id=tenant) == {(tenant, "terse"): ["a"], (tenant, "verbose"): ["b", "c"]}
        set_cohort(session, tenant_id=tenant, cohort="terse", users=[])
    with sessions() as session:
        assert cohorts(session, tenant_id=tenant) == {(tenant, "verbose"): ["b", "c"]}
