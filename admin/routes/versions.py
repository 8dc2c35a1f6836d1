"""Model versions: list with metrics and lineage, detail, promote and roll back through the hot swap.

Promote serves a candidate; roll back serves again a version that served before. Both go through
the server's weight service (the zero-failure rolling swap of ``POST /admin/weights``): the engine
changes weights first and the version row is promoted only once it did. The audit entry is written
after the swap, since an engine swap cannot share a database transaction; a refused swap is audited
with its status. A candidate an evaluation holds back stays ``candidate`` with its ``status_reason``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from sqlalchemy.orm import Session, sessionmaker

from admin.deps import ActorDep, ReasonRequest, SessionsDep, audit_refusal, in_thread
from admin.routes.pages import Limit, page
from admin.schemas import ModelVersionDetail, ModelVersionPage
from server.engines.base import EngineError
from server.errors import ApiError
from server.response_models import RolledOut
from server.routes.deps import AdminDep, WeightsDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.audit import record_admin_action
from storage.learning_errors import NotFoundError
from storage.model_versions import ModelVersionView, get_version
from storage.round_search import search_versions, version_lineage

router = APIRouter()

VersionStatus = Literal["candidate", "serving", "retired", "rejected"]
Action = Literal["promote", "rollback"]
# Which statuses each action may start from; the message says what to do instead.
ALLOWED: dict[Action, dict[str, str | None]] = {
    "promote": {
        "candidate": None,
        "serving": "it already serves",
        "retired": "it served before: roll back to it instead",
        "rejected": "it was rejected",
    },
    "rollback": {
        "retired": None,
        "serving": "it already serves",
        "candidate": "it never served: promote it instead",
        "rejected": "it was rejected",
    },
}


@router.get("/admin/models", response_model=ModelVersionPage, responses=ERRORS)
async def list_versions(
    _: AdminDep,
    sessions: SessionsDep,
    model: Annotated[str | None, Query(max_length=256)] = None,
    status: VersionStatus | None = None,
    before: Annotated[str | None, Query(max_length=128, description="next_before of the previous page.")] = None,
    limit: Limit = 50,
) -> Response:
    def read() -> list[dict[str, Any]]:
        with sessions() as session:
            rows = search_versions(session, model=model, status=status, before=before, limit=limit + 1)
            return [_public(row, version_lineage(session, version_id=row.id)) for row in rows]

    try:
        rows = await in_thread(read)
    except NotFoundError as exc:
        raise ApiError(
            400, f"{exc}: pass next_before from a previous page.", param="before", code="invalid_cursor"
        ) from exc
    return json_response(page(rows, limit, lambda version: version["id"]))


@router.get("/admin/models/{version_id}", response_model=ModelVersionDetail, responses=ERRORS)
async def get_version_detail(version_id: str, _: AdminDep, sessions: SessionsDep) -> Response:
    def read() -> dict[str, Any]:
        with sessions() as session:
            chain = version_lineage(session, version_id=version_id)
            return _public(chain[0], chain, ancestors=True)

    try:
        return json_response(await in_thread(read))
    except NotFoundError as exc:
        raise _not_found(exc) from exc


@router.post("/admin/models/{version_id}/promote", response_model=RolledOut, responses={**ERRORS, **CONFLICT})
async def promote(
    version_id: str, actor: ActorDep, sessions: SessionsDep, weights: WeightsDep, body: ReasonRequest | None = None
) -> Response:
    """Serve a candidate on every replica (rolling hot swap)."""
    return await _swap("promote", version_id, actor, sessions, weights, body)


@router.post("/admin/models/{version_id}/rollback", response_model=RolledOut, responses={**ERRORS, **CONFLICT})
async def rollback(
    version_id: str, actor: ActorDep, sessions: SessionsDep, weights: WeightsDep, body: ReasonRequest | None = None
) -> Response:
    """Serve again a version that served before (rolling hot swap)."""
    return await _swap("rollback", version_id, actor, sessions, weights, body)


async def _swap(
    action: Action,
    version_id: str,
    actor: str,
    sessions: sessionmaker[Session],
    weights: WeightsDep,
    body: ReasonRequest | None,
) -> Response:
    audit_action = f"version.{action}"
    try:
        version = await in_thread(_checked, sessions, action, version_id)
        result = await weights.roll_out(version.checkpoint_path, version.id)
    except ApiError as exc:
        raise await audit_refusal(sessions, exc, actor=actor, action=audit_action, target=version_id) from exc
    except EngineError as exc:  # replicas unavailable mid-swap: audited, answered by the engine error handler
        failed = ApiError(exc.status, str(exc), code="engine_error")
        await audit_refusal(sessions, failed, actor=actor, action=audit_action, target=version_id)
        raise
    details = {
        "model": version.model,
        "previous_version": result["previous_version"],
        "checkpoint_path": version.checkpoint_path,
        "swap_s": result["swap_s"],
        "reason": body.reason if body else None,
    }

    def write() -> None:
        with sessions.begin() as session:
            record_admin_action(session, actor=actor, action=audit_action, target=version_id, details=details)

    await in_thread(write)
    return json_response(result)


def _checked(sessions: sessionmaker[Session], action: Action, version_id: str) -> ModelVersionView:
    with sessions() as session:
        try:
            version = get_version(session, version_id=version_id)
        except NotFoundError as exc:
            raise _not_found(exc) from exc
    refusal = ALLOWED[action].get(version.status, f"it is {version.status}")
    if refusal is not None:
        raise ApiError(
            409, f"Cannot {action.replace('rollback', 'roll back to')} {version_id}: {refusal}.", code="version_state"
        )
    return version


def _not_found(exc: NotFoundError) -> ApiError:
    return ApiError(404, f"{exc.args[0]}.", param="version_id", code="version_not_found")


def _public(
    version: ModelVersionView, chain: tuple[ModelVersionView, ...], *, ancestors: bool = False
) -> dict[str, Any]:
    """The version row; ``lineage`` is its id then its ancestors' ids, ``ancestors`` their rows too."""
    body: dict[str, Any] = {**asdict(version), "object": "model_version", "lineage": [v.id for v in chain]}
    if ancestors:
        body["ancestors"] = [
            {"id": v.id, "status": v.status, "created_at": v.created_at, "watermark": v.watermark, "metrics": v.metrics}
            for v in chain[1:]
        ]
    return body
