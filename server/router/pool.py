"""EnginePool: several replicas behind the Engine interface.

The pool composes three parts: Placement (placement.py: affinity ring, bounded load) picks a replica
per request, HealthMonitor (health.py) ejects and readmits replicas, and RollingUpdater (rolling.py)
changes their weights. The pool itself dispatches requests: a request that fails before anything reached
its consumer (connection refused, a stalled or malformed reply, a full queue, an abort before the
first token) is retried on another replica, each replica at most once. A buffered request
(``stream=False``) reaches its consumer only when complete, so it is retried whenever it fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from server.engines.base import (
    DEFAULT_PRIORITY,
    AdapterRef,
    EngineError,
    EngineUnavailable,
    ModelInfo,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from server.engines.sglang_client import SGLangClient
from server.engines.supervisor import Supervisor
from server.router.config import PoolConfig
from server.router.health import HealthMonitor
from server.router.placement import Placement
from server.router.replica import Replica
from server.router.rolling import RollingUpdater, Split, from_disk
from server.weight_delta import WeightDelta

__all__ = ["EnginePool", "PoolConfig"]  # PoolConfig lives in config.py; importable from here as before

log = logging.getLogger(__name__)


class EnginePool:
    replica = "pool"

    def __init__(
        self, clients: Sequence[SGLangClient], config: PoolConfig | None = None, *, supervisor: Supervisor | None = None
    ) -> None:
        """``supervisor``: the managed processes behind some of the replicas, stopped with the pool."""
        if not clients:
            raise ValueError("an engine pool needs at least one replica")
        self.config = config or PoolConfig()
        self.replicas = {client.replica: Replica(client.replica, client) for client in clients}
        self.placement = Placement(list(self.replicas), self.config)
        self.updater = RollingUpdater(self.replicas)
        self.monitor = HealthMonitor(self.replicas, self.config, self.updater)
        self.supervisor = supervisor

    @classmethod
    async def open(
        cls,
        urls: Sequence[str],
        config: PoolConfig | None = None,
        *,
        start_timeout_s: float = 60.0,
        request_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        supervisor: Supervisor | None = None,
    ) -> EnginePool:
        adapters = (config or PoolConfig()).max_loaded_adapters
        clients = [
            SGLangClient(
                url, timeout_s=request_timeout_s, stall_timeout_s=stall_timeout_s, max_loaded_adapters=adapters
            )
            for url in urls
        ]
        pool = cls(clients, config, supervisor=supervisor)
        try:
            await pool.start(start_timeout_s)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def start(self, timeout_s: float) -> None:
        """Admit every replica that answers; wait for at least one; then watch them all."""
        await self.monitor.start(timeout_s)

    @property
    def target(self) -> tuple[str, str] | None:
        """The weights every replica must serve: (model_path, weight_version)."""
        return self.updater.target

    # ---- the Engine interface ----

    def model_info(self) -> ModelInfo:
        split = self.updater.split
        # A healthy replica on the pool's own weights first (a base canary's replicas serve others).
        for replica in sorted(
            self.replicas.values(), key=lambda r: (not r.healthy, split is not None and r.name in split.replicas)
        ):
            try:
                return replica.client.model_info()
            except EngineUnavailable:
                continue
        raise EngineUnavailable("no engine replica has answered /model_info")

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        session_key: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        priority: int = DEFAULT_PRIORITY,
        adapter: AdapterRef | None = None,
        weight_version: str | None = None,
    ) -> AsyncIterator[TokenChunk]:
        tried: set[str] = set()
        # While a base canary splits the pool, the request keeps to its side's replicas (any, when
        # none of them is in rotation: serving comes first; the chunks say which weights answered).
        side = self.updater.serving(weight_version)
        other_side = set(self.replicas) - side if side and any(self.replicas[n].healthy for n in side) else set()
        failures: list[EngineError] = []
        options: dict[str, Any] = {
            "session_key": session_key,
            "cache_salt": cache_salt,
            "request_id": request_id,
            "stream": stream,
            "priority": priority,
            "adapter": adapter,
        }
        # A scope's requests keep to the replicas where its adapter is resident.
        affinity = (adapter.scope or adapter.key) if adapter is not None else session_key
        while True:
            replica = self.placement.choose(
                self.replicas.values(), affinity, exclude=tried | other_side, failures=failures
            )
            tried.add(replica.name)
            attempt = self._attempt(replica, input_ids, sampling, options)
            delivered = False
            try:
                if stream:
                    async for chunk in attempt:
                        delivered = True
                        yield chunk
                else:
                    chunks = await self._collect(replica, attempt)
                    delivered = True
                    for chunk in chunks:
                        yield chunk
                return
            except _RetryElsewhere as retry:
                if delivered:  # only reachable for a broken stream after its first chunk
                    raise EngineError(str(retry), 502) from retry
                failures.append(retry.cause)
                self._note_failure(replica, retry.cause, request_id, attempts=len(tried))
            except EngineError as exc:
                if delivered or not exc.retryable:
                    raise
                failures.append(exc)
                self._note_failure(replica, exc, request_id, attempts=len(tried))
            finally:
                await attempt.aclose()

    async def _collect(self, replica: Replica, attempt: AsyncGenerator[TokenChunk, None]) -> list[TokenChunk]:
        """A buffered request's whole answer, given up if its replica leaves the rotation meanwhile.

        A one-piece reply sends no byte until it is complete, so no read timeout can tell a long
        generation from a hung server; a failed health probe can, and the request moves on.
        """
        collecting = asyncio.ensure_future(_drain(attempt))
        ejected = asyncio.ensure_future(replica.ejected.wait())
        try:
            await asyncio.wait({collecting, ejected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ejected.cancel()
            if not collecting.done():
                collecting.cancel()
                await asyncio.gather(collecting, return_exceptions=True)
        if collecting.cancelled():
            raise _RetryElsewhere(EngineUnavailable(f"{replica.name} left the rotation during the request"))
        return collecting.result()

    async def _attempt(
        self,
        replica: Replica,
        input_ids: list[int],
        sampling: SamplingParams,
        options: dict[str, Any],
    ) -> AsyncGenerator[TokenChunk, None]:
        """One replica's chunks, stamped with its name; counts the request in its load meanwhile."""
        replica.in_flight += 1
        chunks = replica.client.generate(input_ids, sampling, **options)
        first = True
        try:
            async for chunk in chunks:
                if first and not chunk.token_ids and chunk.finish is not None and chunk.finish.type == "abort":
                    # Aborted before producing anything (a pause in abort mode): nothing is lost by moving.
                    raise _RetryElsewhere(EngineUnavailable(f"{replica.name} aborted: {chunk.finish.message}"))
                first = False
                chunk.replica = replica.name
                yield chunk
        finally:
            replica.in_flight -= 1
            await chunks.aclose()

    async def health(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause every replica; new requests wait inside the servers until resume."""
        for replica in self.replicas.values():
            replica.draining = True
        await asyncio.gather(*(r.client.pause(mode) for r in self.replicas.values() if r.healthy))

    async def resume(self) -> None:
        await asyncio.gather(*(r.client.resume() for r in self.replicas.values() if r.healthy))
        for replica in self.replicas.values():
            replica.draining = False

    async def update_weights(self, model_path: str, weight_version: str) -> None:
        """Rolling update from disk, one replica at a time (RollingUpdater.roll): no request fails,
        an unreachable replica is ejected, a refusal rolls the updated ones back."""
        await self.updater.roll(model_path, weight_version, from_disk(model_path, weight_version))

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """The same rolling update; each replica gets the delta or, if it cannot apply it, ``model_path``."""
        await self.updater.roll(
            model_path,
            weight_version,
            lambda client: client.update_weights_from_delta(delta, model_path, weight_version),
        )

    async def update_weights_together(
        self, model_path: str, weight_version: str, load: Callable[[list[SGLangClient]], Awaitable[None]]
    ) -> None:
        """All replicas at once, for a load that reaches them together (a trainer's broadcast).

        Every healthy replica is drained and paused (retract: no request fails, new ones wait in the
        servers), ``load(clients)`` runs, and each must then report ``weight_version``. If ``load``
        fails, is cancelled or leaves a replica on another version, every paused replica goes back
        to the pool's weights from disk (it may hold part of the new ones). All resume either way.
        ``model_path``, the same weights on disk, is what returning replicas load afterwards.
        """
        await self.updater.update_together(model_path, weight_version, load)

    async def start_canary(self, model_path: str, weight_version: str, replicas: int) -> Split:
        """Split the pool: ``replicas`` of it load ``model_path`` (RollingUpdater.start_split)."""
        return await self.updater.start_split(model_path, weight_version, replicas)

    async def end_canary(self, promote: bool) -> Split:
        """End the split: the candidate everywhere (promote) or nowhere (RollingUpdater.end_split)."""
        return await self.updater.end_split(promote)

    @property
    def canary(self) -> Split | None:
        return self.updater.split

    async def flush_cache(self) -> bool:
        results = await asyncio.gather(*(r.client.flush_cache() for r in self.replicas.values() if r.healthy))
        return all(results)

    # ---- operator drain ----

    def drain(self, name: str) -> Replica:
        """Take ``name`` out of rotation: its requests finish there, its sessions move to the next
        replica on the ring. Draining the last replica in rotation is refused (ValueError): its
        requests would have nowhere else to go.

        Raises:
            KeyError: no replica is called ``name``.
        """
        replica = self.replicas[name]
        if replica.eligible and not any(r.eligible for r in self.replicas.values() if r is not replica):
            raise ValueError(f"{name} is the only replica in rotation; undrain or restore another first")
        replica.drained = True
        log.info("engine replica drained", extra={"replica": name, "in_flight": replica.in_flight})
        return replica

    def undrain(self, name: str) -> Replica:
        """Put ``name`` back in rotation (once healthy): its sessions return to it.

        Raises:
            KeyError: no replica is called ``name``.
        """
        replica = self.replicas[name]
        replica.drained = False
        log.info("engine replica undrained", extra={"replica": name})
        return replica

    async def close(self) -> None:
        await self.monitor.close()
        await asyncio.gather(*(r.client.close() for r in self.replicas.values()))
        if self.supervisor is not None:
            await self.supervisor.close()

    # ---- failover ----

    def _note_failure(self, replica: Replica, exc: EngineError, request_id: str | None, *, attempts: int) -> None:
        log.warning(
            "engine replica failed a request; retrying on another",
            extra={"replica": replica.name, "error": str(exc), "request_id": request_id, "attempts": attempts},
        )
        # Unreachable or stalled: stop sending it traffic now rather than at the next probe.
        if isinstance(exc, EngineUnavailable) and exc.status == 503 and replica.healthy and not replica.draining:
            replica.eject(str(exc))


async def _drain(chunks: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in chunks]


class _RetryElsewhere(Exception):
    def __init__(self, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.cause = cause
