"""Runs (learning rounds): list and filter, detail, cancel."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from sqlalchemy.orm import Session, sessionmaker

from admin.deps import ActorDep, ReasonRequest, SessionsDep, audit_refusal, in_thread
from admin.routes.pages import Limit, page
from admin.schemas import RunDetail, RunPage
from server.errors import ApiError
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.audit import record_admin_action
from storage.learning_errors import LearningStateError, NotFoundError
from storage.round_search import search_rounds
from storage.rounds import RoundTrigger, TrainingRoundView, cancel_round, get_round

router = APIRouter()

ERROR_TAIL_CHARS = 4000  # a traceback's end says what failed; the start is framework frames
RoundStatus = Literal["queued", "running", "succeeded", "nothing_to_learn", "failed", "cancelled"]


@router.get("/admin/runs", response_model=RunPage, responses=ERRORS)
async def list_runs(
    _: AdminDep,
    sessions: SessionsDep,
    model: Annotated[str | None, Query(max_length=256)] = None,
    status: RoundStatus | None = None,
    trigger: RoundTrigger | None = None,
    since: Annotated[
        datetime | None, Query(description="ISO 8601 with a timezone: rounds created at or after.")
    ] = None,
    before: Annotated[str | None, Query(max_length=64, description="next_before of the previous page.")] = None,
    limit: Limit = 50,
) -> Response:
    if since is not None and since.tzinfo is None:
        raise ApiError(400, "since needs a timezone, e.g. 2026-12-10T08:00:00Z.", param="since", code="invalid_request")

    def read() -> tuple[TrainingRoundView, ...]:
        with sessions() as session:
            return search_rounds(
                session, model=model, status=status, trigger=trigger, since=since, before=before, limit=limit + 1
            )

    try:
        rows = await in_thread(read)
    except NotFoundError as exc:
        raise ApiError(
            400, f"{exc}: pass next_before from a previous page.", param="before", code="invalid_cursor"
        ) from exc
    return json_response(page([_summary(row) for row in rows], limit, lambda run: run["id"]))


@router.get("/admin/runs/{round_id}", response_model=RunDetail, responses=ERRORS)
async def get_run(round_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    view = await in_thread(_get, sessions, round_id)
    return json_response(_detail(view))


@router.post("/admin/runs/{round_id}/cancel", response_model=RunDetail, responses={**ERRORS, **CONFLICT})
async def cancel_run(
    round_id: str, actor: ActorDep, sessions: SessionsDep, body: ReasonRequest | None = None
) -> Response:
    """Cancel a queued or running round; a running one stops at its next stage boundary."""
    reason = body.reason if body else None

    def cancel() -> TrainingRoundView:
        # The audit entry commits with the cancellation, or neither does.
        with sessions.begin() as session:
            before = get_round(session, round_id=round_id).status
            view = cancel_round(session, round_id=round_id)
            details = {"previous_status": before, "reason": reason}
            record_admin_action(session, actor=actor, action="run.cancel", target=round_id, details=details)
            return view

    try:
        view = await in_thread(cancel)
    except NotFoundError as exc:
        raise await audit_refusal(sessions, _not_found(exc), actor=actor, action="run.cancel", target=round_id) from exc
    except LearningStateError as exc:
        error = ApiError(409, f"{exc}: only a queued or running round can be cancelled.", code="round_finished")
        raise await audit_refusal(sessions, error, actor=actor, action="run.cancel", target=round_id) from exc
    return json_response(_detail(view))


def _get(sessions: sessionmaker[Session], round_id: str) -> TrainingRoundView:
    with sessions() as session:
        try:
            return get_round(session, round_id=round_id)
        except NotFoundError as exc:
            raise _not_found(exc) from exc


def _not_found(exc: NotFoundError) -> ApiError:
    return ApiError(404, f"{exc.args[0]}.", param="round_id", code="round_not_found")


def _summary(view: TrainingRoundView) -> dict[str, Any]:
    error = view.error.strip().splitlines()[-1] if view.error and view.error.strip() else view.error
    return {
        "id": view.id,
        "object": "run",
        "model": view.model,
        "status": view.status,
        "trigger": view.trigger,
        "schedule_id": view.schedule_id,
        "base_version_id": view.base_version_id,
        "produced_version_id": view.produced_version_id,
        "watermark_from": view.watermark_from,
        "watermark_to": view.watermark_to,
        "samples_collected": view.samples_collected,
        "samples_trained": view.samples_trained,
        "metrics": view.metrics,
        "duration_s": _duration(view),
        "created_at": view.created_at,
        "started_at": view.started_at,
        "finished_at": view.finished_at,
        "error": error,
        "reason": view.reason,
    }


def _duration(view: TrainingRoundView) -> float | None:
    """Seconds from start to finish, or to the last heartbeat while it runs."""
    end = view.finished_at or view.heartbeat_at
    return (end - view.started_at).total_seconds() if end and view.started_at else None


def _detail(view: TrainingRoundView) -> dict[str, Any]:
    return {
        **asdict(view),
        "object": "run",
        "timings": {
            "created_at": view.created_at,
            "started_at": view.started_at,
            "finished_at": view.finished_at,
            "heartbeat_at": view.heartbeat_at,
            "duration_s": _duration(view),
            "stages_s": view.metrics.get("seconds", {}),
        },
        "watermark": {"from": view.watermark_from, "to": view.watermark_to},
        "error": view.error[-ERROR_TAIL_CHARS:] if view.error else None,
    }
