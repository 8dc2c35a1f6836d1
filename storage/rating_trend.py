"""How users rated each model version: the trend the dashboard draws, one point per weight version.

A rated answer counts for the version that started it (``completions.weight_version``); a choice
whose tokens spanned a hot swap still counts once, for the version it began on. Its rating is the
current one (``feedback.score`` in [-1, 1]: up is +1, down is -1), so a changed rating moves the
point instead of counting twice. Runs in the caller's transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from storage.models import Adapter, Completion, Feedback, ModelVersion

__all__ = ["AdapterRating", "VersionRating", "adapter_rating_trend", "rating_trend"]


@dataclass(frozen=True, slots=True)
class VersionRating:
    model: str
    weight_version: str
    status: str | None  # the version row's status; None for weights never recorded (the base model)
    rated: int
    up: int  # score > 0
    down: int  # score < 0
    mean_score: float
    first_at: datetime  # when the first and the last rated answer of this version was created
    last_at: datetime


def _rated(first_at: Any) -> list[Any]:
    """The columns both trends share: rated answers, ups, downs, mean score, first and last answer."""
    return [
        func.count().label("rated"),
        func.sum(case((Feedback.score > 0, 1), else_=0)).label("up"),
        func.sum(case((Feedback.score < 0, 1), else_=0)).label("down"),
        func.avg(Feedback.score).label("mean_score"),
        first_at.label("first_at"),
        func.max(Completion.created_at).label("last_at"),
    ]


def _counts(row: Any) -> dict[str, Any]:
    return {
        "rated": int(row.rated),
        "up": int(row.up),
        "down": int(row.down),
        "mean_score": float(row.mean_score),
        "first_at": row.first_at,
        "last_at": row.last_at,
    }


def rating_trend(session: Session, *, model: str | None = None) -> list[VersionRating]:
    """Every version with at least one rated answer, in the order they first answered (oldest first)."""
    first_at = func.min(Completion.created_at)
    query = (
        select(
            Completion.model,
            Completion.weight_version,
            ModelVersion.status,
            *_rated(first_at),
        )
        .join(Completion, Completion.id == Feedback.completion_id)
        .outerjoin(ModelVersion, ModelVersion.id == Completion.weight_version)
        .group_by(Completion.model, Completion.weight_version, ModelVersion.status)
        .order_by(first_at, Completion.weight_version)
    )
    if model is not None:
        query = query.where(Completion.model == model)
    return [
        VersionRating(
            model=row.model,
            weight_version=row.weight_version,
            status=row.status,
            **_counts(row),
        )
        for row in session.execute(query)
    ]


@dataclass(frozen=True, slots=True)
class AdapterRating:
    """How a scope's users rated the answers one of its adapter versions gave (as ``VersionRating``)."""

    model: str
    tenant_id: str
    scope_kind: str
    scope: str
    adapter_id: str
    status: str
    rated: int
    up: int
    down: int
    mean_score: float
    first_at: datetime
    last_at: datetime


def adapter_rating_trend(
    session: Session, *, model: str | None = None, tenant_id: str | None = None
) -> list[AdapterRating]:
    """Every adapter version with a rated answer, by scope, each scope's in the order they first answered."""
    first_at = func.min(Completion.created_at)
    query = (
        select(
            Adapter.model,
            Adapter.tenant_id,
            Adapter.scope_kind,
            Adapter.scope,
            Adapter.id,
            Adapter.status,
            *_rated(first_at),
        )
        .join(Completion, Completion.id == Feedback.completion_id)
        .join(Adapter, Adapter.id == Completion.adapter_id)
        .group_by(Adapter.model, Adapter.tenant_id, Adapter.scope_kind, Adapter.scope, Adapter.id, Adapter.status)
        .order_by(Adapter.tenant_id, Adapter.scope_kind, Adapter.scope, first_at, Adapter.id)
    )
    if model is not None:
        query = query.where(Adapter.model == model)
    if tenant_id is not None:
        query = query.where(Adapter.tenant_id == tenant_id)
    return [
        AdapterRating(
            model=row.model,
            tenant_id=row.tenant_id,
            scope_kind=row.scope_kind,
            scope=row.scope,
            adapter_id=row.id,
            status=row.status,
            **_counts(row),
        )
        for row in session.execute(query)
    ]
