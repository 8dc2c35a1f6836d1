"""Training rounds as the /metrics endpoint reports them: how many per status, how long each took."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import TrainingRound


@dataclass(frozen=True, slots=True)
class RoundTiming:
    model: str
    status: str
    duration_s: float | None  # None until the round has started and finished


def round_timings(session: Session) -> list[RoundTiming]:
    """Every round; a few a day, so reading them all per scrape stays cheap."""
    rows = session.execute(
        select(TrainingRound.model, TrainingRound.status, TrainingRound.started_at, TrainingRound.finished_at)
    )
    return [
        RoundTiming(
            model=row.model,
            status=row.status,
            duration_s=(row.finished_at - row.started_at).total_seconds()
            if row.started_at is not None and row.finished_at is not None
            else None,
        )
        for row in rows
    ]
