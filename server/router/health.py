"""The pool's health monitor: probes every replica on an interval, ejects those that fail, and
readmits them after consecutive passes, once they serve the pool's current weights (a restarted
server may come back with its launch weights)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from server.engines.base import EngineError, EngineUnavailable
from server.router.config import PoolConfig
from server.router.replica import Replica
from server.router.rolling import RollingUpdater

log = logging.getLogger(__name__)


class HealthMonitor:
    """Admission and ejection of a pool's replicas; ``updater`` puts an admitted one on the pool's weights."""

    def __init__(self, replicas: Mapping[str, Replica], config: PoolConfig, updater: RollingUpdater) -> None:
        self.replicas = replicas
        self.config = config
        self.updater = updater
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> None:
        """Admit every replica that answers; wait for at least one; then watch them all."""
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.gather(*(self.admit(r) for r in self.replicas.values()))
            if any(r.healthy for r in self.replicas.values()):
                break
            if time.monotonic() > deadline:
                names = ", ".join(self.replicas)
                raise EngineUnavailable(f"no engine answered within {timeout_s:.0f} s: {names}")
            await asyncio.sleep(min(1.0, self.config.health_interval_s))
        self._task = asyncio.create_task(self._watch(), name="engine-pool-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def admit(self, replica: Replica) -> None:
        """Bring a replica into rotation, on the pool's weights; leave it out if that fails."""
        try:
            await self.updater.sync(replica)
        except EngineError as exc:
            replica.passed_probes = 0
            log.warning("engine replica not admitted", extra={"replica": replica.name, "error": str(exc)})
            return
        replica.admit()
        version = self.updater.target[1] if self.updater.target else None
        log.info("engine replica in rotation", extra={"replica": replica.name, "weight_version": version})

    async def _watch(self) -> None:
        interval = self.config.health_interval_s
        next_round = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, next_round - time.monotonic()))
            next_round += interval
            await asyncio.gather(*(self._probe(r) for r in self.replicas.values() if not r.draining))

    async def _probe(self, replica: Replica) -> None:
        try:
            ok = await asyncio.wait_for(replica.client.health(), self.config.health_timeout_s)
        except TimeoutError:
            ok = False
        if replica.draining:  # paused while the probe ran: its answer says nothing
            return
        if not ok:
            replica.passed_probes = 0
            if replica.healthy:
                replica.eject("health probe failed")
            return
        if replica.healthy:
            return
        replica.passed_probes += 1
        if replica.passed_probes >= self.config.healthy_after:
            await self.admit(replica)
