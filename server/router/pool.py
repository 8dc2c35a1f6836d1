"""EnginePool: several replicas behind the Engine interface.

Routing (affinity.py) picks a replica per request; a request that fails before anything reached
its consumer (connection refused, a stalled or malformed reply, a full queue, an abort before the
first token) is retried on another replica, each replica at most once. A buffered request
(``stream=False``) reaches its consumer only when complete, so it is retried whenever it fails.
A health monitor probes every replica on an interval, ejects those that fail and readmits them after
consecutive passes, once they serve the pool's current weights (a restarted server may come back
with its launch weights).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from server.engines.base import (
    DEFAULT_PRIORITY,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    ModelInfo,
    PauseMode,
    SamplingParams,
    TokenChunk,
)
from server.engines.sglang_client import SGLangClient
from server.engines.supervisor import Supervisor
from server.router.affinity import HashRing, pick_affine, pick_least_loaded, pick_round_robin
from server.router.replica import Replica
from server.weight_delta import WeightDelta

log = logging.getLogger(__name__)

RoutingPolicy = Literal["affinity", "least_loaded", "round_robin"]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    policy: RoutingPolicy = "affinity"
    load_factor: float = 0.25  # eps of the bounded load: a replica may hold (1 + eps) x the average
    load_floor: int = 8  # ... and never fewer than this many requests before its sessions move
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0  # at most the interval, so a dead replica leaves within two intervals
    healthy_after: int = 2  # passed probes in a row before an ejected replica takes traffic again

    def __post_init__(self) -> None:
        if self.load_factor <= 0:
            raise ValueError("load_factor must be > 0")
        if self.load_floor < 0:
            raise ValueError("load_floor must be >= 0")
        if not 0 < self.health_timeout_s <= self.health_interval_s:
            raise ValueError("health_timeout_s must be in (0, health_interval_s]")
        if self.healthy_after < 1:
            raise ValueError("healthy_after must be at least 1")


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
        self._order = list(self.replicas)
        self._ring = HashRing(self._order)
        self._turn = 0
        # The weights every replica must serve: (model_path, weight_version), set by the first admitted one.
        self.target: tuple[str, str] | None = None
        self._weights_lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None
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
        clients = [SGLangClient(url, timeout_s=request_timeout_s, stall_timeout_s=stall_timeout_s) for url in urls]
        pool = cls(clients, config, supervisor=supervisor)
        try:
            await pool.start(start_timeout_s)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def start(self, timeout_s: float) -> None:
        """Admit every replica that answers; wait for at least one; then watch them all."""
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.gather(*(self._try_admit(r) for r in self.replicas.values()))
            if any(r.healthy for r in self.replicas.values()):
                break
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"no engine answered within {timeout_s:.0f} s: {', '.join(self._order)}")
            await asyncio.sleep(min(1.0, self.config.health_interval_s))
        self._monitor = asyncio.create_task(self._watch(), name="engine-pool-health")

    # ---- the Engine interface ----

    def model_info(self) -> ModelInfo:
        for replica in sorted(self.replicas.values(), key=lambda r: not r.healthy):
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
    ) -> AsyncIterator[TokenChunk]:
        tried: set[str] = set()
        failures: list[EngineError] = []
        while True:
            replica = self._route(session_key, exclude=tried, failures=failures)
            tried.add(replica.name)
            attempt = self._attempt(replica, input_ids, sampling, session_key, cache_salt, request_id, stream, priority)
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
        session_key: str | None,
        cache_salt: str | None,
        request_id: str | None,
        stream: bool = True,
        priority: int = DEFAULT_PRIORITY,
    ) -> AsyncGenerator[TokenChunk, None]:
        """One replica's chunks, stamped with its name; counts the request in its load meanwhile."""
        replica.in_flight += 1
        chunks = replica.client.generate(
            input_ids,
            sampling,
            session_key=session_key,
            cache_salt=cache_salt,
            request_id=request_id,
            stream=stream,
            priority=priority,
        )
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
        """Rolling update, one replica at a time: drain, pause (retract), load, continue.

        Retract mode puts running requests back in the server's queue and re-prefills them under the
        new weights, so no request fails. A replica that cannot be reached is ejected and gets the
        new weights when it is readmitted. A replica that refuses them (a bad checkpoint) keeps its
        old ones, and the replicas already updated are rolled back: the pool is not left split.
        """
        await self._roll(model_path, weight_version, _from_disk(model_path, weight_version))

    async def update_weights_from_delta(self, delta: WeightDelta, model_path: str, weight_version: str) -> None:
        """The same rolling update; each replica gets the delta or, if it cannot apply it, ``model_path``."""
        await self._roll(
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
        async with self._weights_lock:
            chosen = [r for r in self.replicas.values() if r.healthy]
            for replica in chosen:
                replica.draining = True
            try:
                paused = await asyncio.gather(*(r.client.pause("retract") for r in chosen), return_exceptions=True)
                for replica, error in zip(chosen, paused, strict=True):
                    if isinstance(error, EngineError):
                        self._eject(replica, f"unreachable during a weight update: {error}")
                    elif isinstance(error, BaseException):
                        raise error
                replicas = [r for r in chosen if r.healthy]
                if not replicas:
                    raise EngineUnavailable(f"no replica could be reached to load {weight_version}")
                try:
                    await load([r.client for r in replicas])
                    infos = await asyncio.gather(*(r.client.refresh_model_info() for r in replicas))
                    stale = [
                        r.name for r, info in zip(replicas, infos, strict=True) if info.weight_version != weight_version
                    ]
                    if stale:
                        raise EngineError(f"{', '.join(stale)} did not end on {weight_version}", 400)
                except BaseException:
                    await self._roll_back(replicas)
                    raise
                self.target = (model_path, weight_version)
            finally:
                await asyncio.gather(*(r.client.resume() for r in chosen if r.healthy), return_exceptions=True)
                for replica in chosen:
                    replica.draining = False
        log.info("pool weights updated together", extra={"weight_version": weight_version, "replicas": len(replicas)})

    async def _roll(
        self, model_path: str, weight_version: str, load: Callable[[SGLangClient], Awaitable[None]]
    ) -> None:
        async with self._weights_lock:
            updated: list[Replica] = []
            for replica in [r for r in self.replicas.values() if r.healthy]:
                try:
                    await self._update_one(replica, load)
                    updated.append(replica)
                except EngineUnavailable as exc:
                    self._eject(replica, f"unreachable during a weight update: {exc}")
                except EngineError as exc:
                    await self._roll_back(updated)
                    raise EngineError(f"{replica.name} refused {model_path}: {exc}", 400) from exc
            if not updated:
                raise EngineUnavailable(f"no replica could be reached to load {model_path}")
            self.target = (model_path, weight_version)
            log.info("pool weights updated", extra={"weight_version": weight_version, "replicas": len(updated)})

    async def _roll_back(self, replicas: list[Replica]) -> None:
        if self.target is None:
            return
        for replica in replicas:
            try:
                await self._update_one(replica, _from_disk(*self.target))
            except EngineError as exc:  # it must not serve the refused version: out until readmitted
                self._eject(replica, f"could not roll back to {self.target[1]}: {exc}")

    async def _update_one(self, replica: Replica, load: Callable[[SGLangClient], Awaitable[None]]) -> None:
        replica.draining = True
        try:
            await replica.client.pause("retract")
            try:
                await load(replica.client)
            finally:
                await replica.client.resume()
        finally:
            replica.draining = False

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
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        await asyncio.gather(*(r.client.close() for r in self.replicas.values()))
        if self.supervisor is not None:
            await self.supervisor.close()

    # ---- routing ----

    def _route(self, session_key: str | None, *, exclude: set[str], failures: Sequence[EngineError] = ()) -> Replica:
        candidates = [r for r in self.replicas.values() if r.name not in exclude]
        # Draining replicas queue requests until they resume: a last resort, never a refusal.
        usable = [r for r in candidates if r.eligible] or [r for r in candidates if r.healthy]
        if not usable:
            if failures and all(isinstance(f, EngineOverloaded) for f in failures):
                raise EngineOverloaded("every engine replica's queue is full; retry later")
            tried = f" after trying {', '.join(sorted(exclude))}" if exclude else ""
            last = f" (last error: {failures[-1]})" if failures else ""
            raise EngineUnavailable(f"no engine replica is available{tried}{last}")
        loads = {r.name: r.in_flight for r in usable}
        policy = self.config.policy
        if policy == "affinity" and session_key:
            name = pick_affine(self._ring, session_key, loads, self.config.load_factor, self.config.load_floor)
        elif policy == "round_robin":
            name = pick_round_robin(loads, self._order, self._turn)
            self._turn += 1
        else:
            name = pick_least_loaded(loads, self._order)
        if name is None:  # unreachable: usable is not empty
            raise EngineUnavailable("no engine replica is available")
        return self.replicas[name]

    def _note_failure(self, replica: Replica, exc: EngineError, request_id: str | None, *, attempts: int) -> None:
        log.warning(
            "engine replica failed a request; retrying on another",
            extra={"replica": replica.name, "error": str(exc), "request_id": request_id, "attempts": attempts},
        )
        # Unreachable or stalled: stop sending it traffic now rather than at the next probe.
        if isinstance(exc, EngineUnavailable) and exc.status == 503 and replica.healthy and not replica.draining:
            self._eject(replica, str(exc))

    # ---- health ----

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
                self._eject(replica, "health probe failed")
            return
        if replica.healthy:
            return
        replica.passed_probes += 1
        if replica.passed_probes >= self.config.healthy_after:
            await self._try_admit(replica)

    async def _try_admit(self, replica: Replica) -> None:
        """Bring a replica into rotation, on the pool's weights; leave it out if that fails."""
        async with self._weights_lock:
            try:
                info = await replica.client.refresh_model_info()
                if self.target is None:
                    self.target = (info.model_path, info.weight_version)
                elif info.weight_version != self.target[1]:
                    log.info(
                        "loading the pool's weights into a returning replica",
                        extra={"replica": replica.name, "had": info.weight_version, "weight_version": self.target[1]},
                    )
                    await self._update_one(replica, _from_disk(*self.target))
            except EngineError as exc:
                replica.passed_probes = 0
                log.warning("engine replica not admitted", extra={"replica": replica.name, "error": str(exc)})
                return
        replica.healthy = True
        replica.ejected.clear()
        log.info("engine replica in rotation", extra={"replica": replica.name, "weight_version": self.target[1]})

    def _eject(self, replica: Replica, reason: str) -> None:
        replica.healthy = False
        replica.passed_probes = 0
        replica.ejected.set()
        log.warning("engine replica out of rotation", extra={"replica": replica.name, "reason": reason})


def _from_disk(model_path: str, weight_version: str) -> Callable[[SGLangClient], Awaitable[None]]:
    return lambda client: client.update_weights(model_path, weight_version)


async def _drain(chunks: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in chunks]


class _RetryElsewhere(Exception):
    def __init__(self, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.cause = cause
