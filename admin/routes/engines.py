"""/admin/engines: the serving replicas (health, weights, load, cache hits), drain and undrain.

A drained replica finishes what it has and takes no new requests while another replica can take
them; its sessions move to the next replica on the ring and come back when it is undrained. The
in-process local engine is a single replica, which cannot be drained (nothing could take its traffic).
Replicas are named by their URL (``http://host:port``), which goes into the path as it is.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session, sessionmaker

from admin.deps import ActorDep, SessionsDep, audit_refusal, in_thread
from admin.schemas import EngineReplica, EngineReplicaList
from server.engine_status import ReplicaState, replica_states
from server.errors import ApiError
from server.metrics import GatewayMetrics
from server.router.pool import EnginePool
from server.routes.deps import AdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.audit import record_admin_action

router = APIRouter()


def replica_view(state: ReplicaState, metrics: GatewayMetrics) -> dict[str, Any]:
    return {
        "id": state.name,
        "object": "engine_replica",
        "healthy": state.healthy,
        "drained": state.drained,
        "updating_weights": state.updating,
        "weight_version": state.weight_version,
        "in_flight": state.in_flight,
        "cache_hit_ratio": metrics.cache_hit_ratio(state.name),
    }


async def _views(request: Request) -> dict[str, dict[str, Any]]:
    metrics = request.app.state.metrics
    return {s.name: replica_view(s, metrics) for s in await replica_states(request.app.state.engine)}


def _not_found(name: str, known: list[str]) -> ApiError:
    return ApiError(
        404,
        f"No engine replica '{name}'; the replicas are: {', '.join(known)}.",
        param="replica",
        code="replica_not_found",
    )


@router.get("/admin/engines", response_model=EngineReplicaList, responses=ERRORS)
async def get_engines(_: AdminDep, request: Request) -> Response:
    return json_response({"object": "list", "data": list((await _views(request)).values())})


@router.get("/admin/engines/{replica:path}", response_model=EngineReplica, responses=ERRORS)
async def get_engine(replica: str, _: AdminDep, request: Request) -> Response:
    views = await _views(request)
    if replica not in views:
        raise _not_found(replica, list(views))
    return json_response(views[replica])


async def _audit(
    sessions: sessionmaker[Session], actor: str, action: str, target: str, details: dict[str, Any]
) -> None:
    def write() -> None:
        with sessions.begin() as session:
            record_admin_action(session, actor=actor, action=action, target=target, details=details)

    await in_thread(write)


async def _set_drained(
    request: Request, actor: str, sessions: sessionmaker[Session], replica: str, drained: bool
) -> Response:
    engine = request.app.state.engine
    action = "engine.drain" if drained else "engine.undrain"
    if not isinstance(engine, EnginePool):
        views = await _views(request)
        if replica not in views:
            raise _not_found(replica, list(views))
        raise ApiError(
            409,
            f"{replica} is the in-process engine, the only replica: draining it would leave nothing to serve.",
            param="replica",
            code="cannot_drain",
        )
    if replica not in engine.replicas:
        raise _not_found(replica, list(engine.replicas))
    before = engine.replicas[replica].drained
    try:
        if drained:
            engine.drain(replica)
        else:
            engine.undrain(replica)
    except ValueError as exc:
        raise ApiError(409, str(exc), param="replica", code="cannot_drain") from exc
    try:
        await _audit(sessions, actor, action, replica, {"was_drained": before})
    except ApiError:  # the database is away: no unaudited effect, put it back as it was
        engine.replicas[replica].drained = before
        raise
    return json_response((await _views(request))[replica])


async def _audited_set(
    request: Request, actor: str, sessions: sessionmaker[Session], replica: str, drained: bool
) -> Response:
    try:
        return await _set_drained(request, actor, sessions, replica, drained)
    except ApiError as error:
        if not 400 <= error.status < 500:
            raise
        action = "engine.drain" if drained else "engine.undrain"
        raise await audit_refusal(sessions, error, actor=actor, action=action, target=replica) from error


@router.post("/admin/engines/{replica:path}/drain", response_model=EngineReplica, responses={**ERRORS, **CONFLICT})
async def drain(replica: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Take a replica out of rotation; 409 for the last one in rotation or the local engine."""
    return await _audited_set(request, actor, sessions, replica, True)


@router.post("/admin/engines/{replica:path}/undrain", response_model=EngineReplica, responses={**ERRORS, **CONFLICT})
async def undrain(replica: str, actor: ActorDep, sessions: SessionsDep, request: Request) -> Response:
    """Put a drained replica back in rotation; its sessions return to it."""
    return await _audited_set(request, actor, sessions, replica, False)
