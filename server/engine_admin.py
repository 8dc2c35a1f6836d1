"""The engine operations the admin API may perform: list the serving replicas, drain and undrain them.

The server owns the serving state (the engine or pool in ``app.state``); the admin routes change it
only through this service, which answers in the API's errors (404 for an unknown replica, 409 for a
drain that would leave nothing serving).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from server.engine_status import ReplicaState, replica_states
from server.engines.base import Engine
from server.errors import ApiError
from server.metrics import GatewayMetrics
from server.router.pool import EnginePool

log = logging.getLogger(__name__)


class EngineAdmin:
    """The serving engine as an operator sees it; a non-pool engine is one replica that cannot drain."""

    def __init__(self, engine: Engine, metrics: GatewayMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    async def replicas(self) -> list[ReplicaState]:
        return await replica_states(self._engine)

    async def replica(self, name: str) -> ReplicaState:
        """Raises ApiError 404 when no replica is called ``name``."""
        states = {state.name: state for state in await self.replicas()}
        if name not in states:
            raise _not_found(name, list(states))
        return states[name]

    def cache_hit_ratio(self, name: str) -> float | None:
        """Cached over prompt tokens of what this gateway sent ``name``; None before any request."""
        return self._metrics.cache_hit_ratio(name)

    @contextmanager
    def set_drained(self, name: str, drained: bool) -> Iterator[bool]:
        """Drain (or undrain) ``name``, yielding whether it was drained before; if the block raises
        (its audit could not be written), the replica is put back as it was: no unrecorded change.

        Raises:
            ApiError: 404 for an unknown replica; 409 for the in-process engine or the last replica
                in rotation.
        """
        pool = self._pool(name)
        before = pool.replicas[name].drained
        try:
            if drained:
                pool.drain(name)
            else:
                pool.undrain(name)
        except ValueError as exc:
            raise ApiError(409, str(exc), param="replica", code="cannot_drain") from exc
        try:
            yield before
        except BaseException:
            pool.replicas[name].drained = before
            log.info("engine replica drain undone", extra={"replica": name, "drained": before})
            raise

    def _pool(self, name: str) -> EnginePool:
        """The pool holding ``name``, or the ApiError that says why it cannot be drained."""
        engine = self._engine
        if not isinstance(engine, EnginePool):
            if name != engine.replica:
                raise _not_found(name, [engine.replica])
            raise ApiError(
                409,
                f"{name} is the in-process engine, the only replica: draining it would leave nothing to serve.",
                param="replica",
                code="cannot_drain",
            )
        if name not in engine.replicas:
            raise _not_found(name, list(engine.replicas))
        return engine


def _not_found(name: str, known: list[str]) -> ApiError:
    return ApiError(
        404,
        f"No engine replica '{name}'; the replicas are: {', '.join(known)}.",
        param="replica",
        code="replica_not_found",
    )
