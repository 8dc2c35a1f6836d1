"""/admin/engines: the serving replicas (health, weights, load, cache hits), drain and undrain.

A drained replica finishes what it has and takes no new requests while another replica can take
them; its sessions move to the next replica on the ring and come back when it is undrained. The
in-process local engine is a single replica, which cannot be drained (nothing could take its traffic).
Replicas are named by their URL (``http://host:port``), which goes into the path as it is.
Every change goes through the server's EngineAdmin (server.engine_admin), which owns the pool.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from sqlalchemy.orm import Session, sessionmaker

from admin.deps import ActorDep, SessionsDep, audit_refusal, in_thread
from admin.schemas import EngineReplica, EngineReplicaList
from server.engine_admin import EngineAdmin
from server.engine_status import ReplicaState
from server.errors import ApiError
from server.routes.deps import AdminDep, EngineAdminDep, json_response
from server.schemas import CONFLICT, ERRORS
from storage.audit import record_admin_action

router = APIRouter()


def replica_view(state: ReplicaState, engines: EngineAdmin) -> dict[str, Any]:
    return {
        "id": state.name,
        "object": "engine_replica",
        "healthy": state.healthy,
        "drained": state.drained,
        "updating_weights": state.updating,
        "weight_version": state.weight_version,
        "in_flight": state.in_flight,
        "cache_hit_ratio": engines.cache_hit_ratio(state.name),
    }


@router.get("/admin/engines", response_model=EngineReplicaList, responses=ERRORS)
async def get_engines(_: AdminDep, engines: EngineAdminDep) -> Response:
    views = [replica_view(state, engines) for state in await engines.replicas()]
    return json_response({"object": "list", "data": views})


@router.get("/admin/engines/{replica:path}", response_model=EngineReplica, responses=ERRORS)
async def get_engine(replica: str, _: AdminDep, engines: EngineAdminDep) -> Response:
    return json_response(replica_view(await engines.replica(replica), engines))


async def _audit(
    sessions: sessionmaker[Session], actor: str, action: str, target: str, details: dict[str, Any]
) -> None:
    def write() -> None:
        with sessions.begin() as session:
            record_admin_action(session, actor=actor, action=action, target=target, details=details)

    await in_thread(write)


async def _audited_set(
    engines: EngineAdmin, actor: str, sessions: sessionmaker[Session], replica: str, drained: bool
) -> Response:
    """Drain or undrain, audited; a refusal (4xx) is audited too. An audit that cannot be written
    (the database is away) undoes the change: no unaudited effect."""
    action = "engine.drain" if drained else "engine.undrain"
    try:
        with engines.set_drained(replica, drained) as before:
            await _audit(sessions, actor, action, replica, {"was_drained": before})
    except ApiError as error:
        if not 400 <= error.status < 500:
            raise
        raise await audit_refusal(sessions, error, actor=actor, action=action, target=replica) from error
    return json_response(replica_view(await engines.replica(replica), engines))


@router.post("/admin/engines/{replica:path}/drain", response_model=EngineReplica, responses={**ERRORS, **CONFLICT})
async def drain(replica: str, actor: ActorDep, sessions: SessionsDep, engines: EngineAdminDep) -> Response:
    """Take a replica out of rotation; 409 for the last one in rotation or the local engine."""
    return await _audited_set(engines, actor, sessions, replica, True)


@router.post("/admin/engines/{replica:path}/undrain", response_model=EngineReplica, responses={**ERRORS, **CONFLICT})
async def undrain(replica: str, actor: ActorDep, sessions: SessionsDep, engines: EngineAdminDep) -> Response:
    """Put a drained replica back in rotation; its sessions return to it."""
    return await _audited_set(engines, actor, sessions, replica, False)
