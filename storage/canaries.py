"""Canaries: a candidate serving a share of its scope's traffic until live ratings decide it.

The candidate is an adapter for a user, cohort or tenant scope, or a model version for the base
(``scope_kind`` ``base``, scope the model, every tenant). A canary runs for one scope; starting one
for a scope whose canary still runs supersedes that one. Each completion its split served records the canary and the side that served
it (``completions.canary_id`` / ``canary_arm``), so the ratings of the two sides are read from the
same period and the same population. Deciding is one conditional UPDATE of a running row: of two
gateways judging at once, exactly one decides, and its adapter change commits with the decision (a
base version's engine change is the caller's, made before: ``server.weights``).

All functions run inside the caller's transaction; the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Table, case, delete, func, select, update
from sqlalchemy.orm import Session

from storage.adapters import set_adapter_status
from storage.learning_errors import NotFoundError
from storage.model_versions import set_version_status
from storage.models import Canary, Completion, Feedback
from storage.times import utcnow

Arm = Literal["canary", "control"]
Decision = Literal["promoted", "rolled_back", "superseded"]

_CANARIES: Table = Canary.__table__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class CanaryView:
    id: str
    model: str
    tenant_id: str | None  # None: a base canary, over every tenant
    scope_kind: str
    scope: str
    candidate_id: str
    control_id: str | None
    share: float
    rules: dict[str, Any]
    status: str
    reason: str | None
    numbers: dict[str, Any]
    started_by: str
    decided_by: str | None
    started_at: datetime
    deadline: datetime
    decided_at: datetime | None


@dataclass(frozen=True, slots=True)
class Thumbs:
    """Rated answers of one side: a positive score counts up, a negative one down, zero neither."""

    up: int = 0
    down: int = 0

    @property
    def rated(self) -> int:
        return self.up + self.down


@dataclass(frozen=True, slots=True)
class CanaryScope:
    """Where a canary splits traffic: an adapter's scope, or the base (``BASE``)."""

    model: str
    tenant_id: str | None
    scope_kind: str
    scope: str

    @classmethod
    def base(cls, model: str) -> CanaryScope:
        return cls(model, None, "base", model)


def start_canary(
    session: Session,
    *,
    canary_id: str,
    scope: CanaryScope,
    candidate_id: str,
    control_id: str | None,
    share: float,
    rules: dict[str, Any],
    started_by: str,
    deadline: datetime,
    now: datetime | None = None,
) -> tuple[CanaryView, str | None]:
    """A running canary of ``candidate_id`` for ``scope``; the id of the canary it superseded, if one ran."""
    now = now or utcnow()
    running = running_canary(session, scope)
    if running is not None:
        decide_canary(
            session,
            canary_id=running.id,
            decision="superseded",
            reason=f"superseded by canary {canary_id} (candidate {candidate_id})",
            numbers=running.numbers,
            decided_by=started_by,
            now=now,
        )
    session.execute(
        _CANARIES.insert().values(
            id=canary_id,
            model=scope.model,
            tenant_id=scope.tenant_id,
            scope_kind=scope.scope_kind,
            scope=scope.scope,
            candidate_id=candidate_id,
            control_id=control_id,
            share=share,
            rules=rules,
            status="running",
            numbers={},
            started_by=started_by,
            started_at=now,
            deadline=deadline,
        )
    )
    return get_canary(session, canary_id=canary_id), running.id if running else None


def decide_canary(
    session: Session,
    *,
    canary_id: str,
    decision: Decision,
    reason: str,
    numbers: dict[str, Any],
    decided_by: str,
    now: datetime | None = None,
) -> bool:
    """End a running canary and apply it to its candidate; False when it had already ended.

    ``promoted`` serves an adapter for its scope (retiring the control), ``rolled_back`` rejects the
    candidate; ``superseded`` leaves it a candidate. A base version's promotion is recorded by the
    weight rollout that serves it (``server.weights``), so here only its rejection.
    """
    now = now or utcnow()
    result: Any = session.execute(
        update(_CANARIES)
        .where(_CANARIES.c.id == canary_id, _CANARIES.c.status == "running")
        .values(status=decision, reason=reason, numbers=numbers, decided_by=decided_by, decided_at=now)
    )
    if result.rowcount != 1:
        return False
    canary = get_canary(session, canary_id=canary_id)
    why = f"canary: {reason}"
    if canary.scope_kind == "base":
        if decision == "rolled_back":
            set_version_status(session, version_id=canary.candidate_id, status="rejected", reason=why, now=now)
    elif decision == "promoted":
        set_adapter_status(session, adapter_id=canary.candidate_id, status="serving", reason=why, now=now)
    elif decision == "rolled_back":
        set_adapter_status(session, adapter_id=canary.candidate_id, status="rejected", reason=why, now=now)
    return True


def record_numbers(session: Session, *, canary_id: str, numbers: dict[str, Any]) -> None:
    """The latest tallies of a running canary, for the admin API and dashboard."""
    session.execute(
        update(_CANARIES).where(_CANARIES.c.id == canary_id, _CANARIES.c.status == "running").values(numbers=numbers)
    )


def arm_thumbs(session: Session, *, canary_id: str) -> dict[Arm, Thumbs]:
    """Each side's rated answers so far (every rated choice of every completion it served)."""
    query = (
        select(
            Completion.canary_arm,
            func.sum(case((Feedback.score > 0, 1), else_=0)),
            func.sum(case((Feedback.score < 0, 1), else_=0)),
        )
        .join(Feedback, Feedback.completion_id == Completion.id)
        .where(Completion.canary_id == canary_id)
        .group_by(Completion.canary_arm)
    )
    found: dict[Arm, Thumbs] = {"canary": Thumbs(), "control": Thumbs()}
    for arm, up, down in session.execute(query):
        if arm in found:
            found[arm] = Thumbs(int(up or 0), int(down or 0))
    return found


def get_canary(session: Session, *, canary_id: str) -> CanaryView:
    row = session.execute(select(_CANARIES).where(_CANARIES.c.id == canary_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"no canary {canary_id}")
    return CanaryView(**row._asdict())


def running_canary(session: Session, scope: CanaryScope) -> CanaryView | None:
    tenant = _CANARIES.c.tenant_id
    row = session.execute(
        select(_CANARIES).where(
            _CANARIES.c.model == scope.model,
            tenant.is_(None) if scope.tenant_id is None else tenant == scope.tenant_id,
            _CANARIES.c.scope_kind == scope.scope_kind,
            _CANARIES.c.scope == scope.scope,
            _CANARIES.c.status == "running",
        )
    ).one_or_none()
    return None if row is None else CanaryView(**row._asdict())


def delete_user_canaries(session: Session, *, tenant_id: str, end_user: str) -> int:
    """Delete the canaries of one user's adapters, of every model (the user-data deletion); how many."""
    mine = (_CANARIES.c.tenant_id == tenant_id) & (_CANARIES.c.scope_kind == "user") & (_CANARIES.c.scope == end_user)
    result: Any = session.execute(delete(_CANARIES).where(mine))
    return int(result.rowcount)


def list_canaries(
    session: Session,
    *,
    model: str | None = None,
    tenant_id: str | None = None,
    status: str | None = None,
    limit: int = 100,
) -> tuple[CanaryView, ...]:
    """Newest first."""
    query = select(_CANARIES).order_by(_CANARIES.c.started_at.desc(), _CANARIES.c.id.desc()).limit(limit)
    for column, value in ((_CANARIES.c.model, model), (_CANARIES.c.tenant_id, tenant_id), (_CANARIES.c.status, status)):
        if value is not None:
            query = query.where(column == value)
    return tuple(CanaryView(**row._asdict()) for row in session.execute(query))
