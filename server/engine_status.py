"""What each serving replica is doing now: the admin API's engines list and the /metrics gauges.

A pool reports its replicas; any other engine (the in-process local one) is a single replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engines.base import Engine, EngineUnavailable
from server.router.pool import EnginePool
from server.router.replica import Replica


@dataclass(frozen=True, slots=True)
class ReplicaState:
    name: str
    healthy: bool  # answering its health probes (in a pool: in rotation unless drained or updating)
    drained: bool  # taken out of rotation by an operator
    updating: bool  # paused for a weight update right now
    weight_version: str | None  # None: it has never answered /model_info
    in_flight: int  # requests sent to it and not finished


def _pool_replica(replica: Replica) -> ReplicaState:
    try:
        version: str | None = replica.client.model_info().weight_version
    except EngineUnavailable:
        version = None
    return ReplicaState(
        name=replica.name,
        healthy=replica.healthy,
        drained=replica.drained,
        updating=replica.draining,
        weight_version=version,
        in_flight=replica.in_flight,
    )


async def replica_states(engine: Engine) -> list[ReplicaState]:
    if isinstance(engine, EnginePool):
        return [_pool_replica(r) for r in engine.replicas.values()]
    return [
        ReplicaState(
            name=engine.replica,
            healthy=await engine.health(),
            drained=False,
            updating=False,
            weight_version=engine.model_info().weight_version,
            in_flight=int(getattr(engine, "in_flight", 0)),
        )
    ]
