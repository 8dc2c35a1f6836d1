"""The pool's weights: rolling updates that drive replicas through pause / update / continue.

Retract mode puts running requests back in the server's queue and re-prefills them under the new
weights, so no request fails. One lock serialises every weight change, including the sync of a
replica the health monitor readmits, so no replica is admitted on weights a rollout is replacing.

A base canary splits the pool (``Split``): some replicas load the candidate's weights, the rest keep
the pool's, and the pool sends each request to the side it asks for. Ending the split rolls the
candidate over the rest (promoted) or the pool's weights back over its replicas (rolled back); a
rollout of other weights meanwhile ends it too (every replica gets them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from server.engines.base import EngineError, EngineUnavailable
from server.engines.sglang_client import SGLangClient
from server.router.replica import Replica

log = logging.getLogger(__name__)

Load = Callable[[SGLangClient], Awaitable[None]]


def from_disk(model_path: str, weight_version: str) -> Load:
    return lambda client: client.update_weights(model_path, weight_version)


@dataclass(frozen=True, slots=True)
class Split:
    """A base canary's replicas, on the candidate's weights while the rest serve the pool's."""

    model_path: str
    weight_version: str
    replicas: frozenset[str]


class RollingUpdater:
    """Changes the weights of a pool's replicas and remembers which ones they must all serve."""

    def __init__(self, replicas: Mapping[str, Replica]) -> None:
        self.replicas = replicas
        # The weights every replica must serve: (model_path, weight_version), set by the first admitted one.
        self.target: tuple[str, str] | None = None
        self.split: Split | None = None  # a base canary's replicas, which serve other weights
        self._lock = asyncio.Lock()

    def serving(self, weight_version: str | None) -> frozenset[str] | None:
        """The replicas that serve ``weight_version`` (None: the pool's own) while the pool is split;
        None when it is not (any replica serves)."""
        split = self.split
        if split is None:
            return None
        if weight_version == split.weight_version:
            return split.replicas
        return frozenset(self.replicas) - split.replicas

    async def start_split(self, model_path: str, weight_version: str, replicas: int) -> Split:
        """Load ``model_path`` onto ``replicas`` of the healthy replicas (at least one, and one fewer
        than all, so both sides serve); a split already running is rolled back first.

        Raises:
            EngineError: 409 with fewer than two healthy replicas; 400 when a replica refuses the
                weights (those loaded already go back to the pool's).
        """
        async with self._lock:
            if self.split is not None:
                await self._restore(self.split)
            healthy = [r for r in self.replicas.values() if r.healthy]
            if len(healthy) < 2:
                raise EngineError(
                    f"a base canary needs two or more engine replicas in rotation, and {len(healthy)} is", 409
                )
            chosen = healthy[-min(max(replicas, 1), len(healthy) - 1) :]
            loaded: list[Replica] = []
            for replica in chosen:
                try:
                    await self._update_one(replica, from_disk(model_path, weight_version))
                except EngineError as exc:
                    await self._roll_back(loaded)
                    raise EngineError(f"{replica.name} refused {model_path}: {exc}", 400) from exc
                loaded.append(replica)
            self.split = Split(model_path, weight_version, frozenset(r.name for r in chosen))
            log.info("pool split for a base canary", extra={"weight_version": weight_version, "replicas": len(chosen)})
            return self.split

    async def end_split(self, promote: bool) -> Split:
        """Promoted: the candidate's weights onto the other replicas, and they become the pool's.
        Rolled back: the pool's weights back onto the canary's replicas.

        Raises:
            EngineError: 409 when the pool is not split; 400 when a replica refuses the candidate's
                weights on promotion (those updated go back, and the split stays).
        """
        async with self._lock:
            split = self.split
            if split is None:
                raise EngineError("no base canary splits the engine pool", 409)
            if promote:
                updated: list[Replica] = []
                for replica in [r for r in self.replicas.values() if r.healthy and r.name not in split.replicas]:
                    try:
                        await self._update_one(replica, from_disk(split.model_path, split.weight_version))
                    except EngineError as exc:
                        await self._roll_back(updated)
                        raise EngineError(f"{replica.name} refused {split.model_path}: {exc}", 400) from exc
                    updated.append(replica)
                self.target = (split.model_path, split.weight_version)
            else:
                await self._restore(split)
            self.split = None
            log.info("pool split ended", extra={"weight_version": split.weight_version, "promoted": promote})
            return split

    async def _restore(self, split: Split) -> None:
        """The pool's weights back onto ``split``'s replicas; one that cannot take them leaves the
        rotation (it must not serve the candidate as the pool's weights)."""
        self.split = None
        await self._roll_back([r for r in self.replicas.values() if r.name in split.replicas and r.healthy])

    async def roll(self, model_path: str, weight_version: str, load: Load) -> None:
        """One healthy replica at a time: drain, pause (retract), ``load``, continue.

        A replica that cannot be reached is ejected and gets the new weights when it is readmitted.
        A replica that refuses them (a bad checkpoint) keeps its old ones, and the replicas already
        updated are rolled back: the pool is not left split.
        """
        async with self._lock:
            updated: list[Replica] = []
            # A split ends: its replicas go first, so a refusal rolls them back to the pool's weights.
            split, self.split = self.split, None
            healthy = [r for r in self.replicas.values() if r.healthy]
            on_split = split.replicas if split is not None else frozenset()
            first = [r for r in healthy if r.name in on_split]
            for replica in first + [r for r in healthy if r.name not in on_split]:
                try:
                    await self._update_one(replica, load)
                    updated.append(replica)
                except EngineUnavailable as exc:
                    replica.eject(f"unreachable during a weight update: {exc}")
                except EngineError as exc:
                    await self._roll_back(updated + [r for r in first if r.name not in {u.name for u in updated}])
                    raise EngineError(f"{replica.name} refused {model_path}: {exc}", 400) from exc
            if not updated:
                raise EngineUnavailable(f"no replica could be reached to load {model_path}")
            self.target = (model_path, weight_version)
            log.info("pool weights updated", extra={"weight_version": weight_version, "replicas": len(updated)})

    async def update_together(
        self, model_path: str, weight_version: str, load: Callable[[list[SGLangClient]], Awaitable[None]]
    ) -> None:
        """Every healthy replica paused at once for ``load(clients)``; see EnginePool.update_weights_together."""
        async with self._lock:
            self.split = None  # every replica gets these weights, or goes back to the pool's
            chosen = [r for r in self.replicas.values() if r.healthy]
            for replica in chosen:
                replica.draining = True
            try:
                replicas = await self._pause_all(chosen, weight_version)
                try:
                    await load([r.client for r in replicas])
                    await self._check_versions(replicas, weight_version)
                except BaseException:
                    await self._roll_back(replicas)
                    raise
                self.target = (model_path, weight_version)
            finally:
                await asyncio.gather(*(r.client.resume() for r in chosen if r.healthy), return_exceptions=True)
                for replica in chosen:
                    replica.draining = False
        log.info("pool weights updated together", extra={"weight_version": weight_version, "replicas": len(replicas)})

    async def sync(self, replica: Replica) -> None:
        """Put a replica on the pool's weights before it is admitted (the first one sets them).

        Raises:
            EngineError: it could not be asked or could not load them.
        """
        async with self._lock:
            info = await replica.client.refresh_model_info()
            if self.target is None:
                self.target = (info.model_path, info.weight_version)
            split = self.split
            wanted = (
                (split.model_path, split.weight_version) if split and replica.name in split.replicas else self.target
            )
            if info.weight_version != wanted[1]:
                log.info(
                    "loading the pool's weights into a returning replica",
                    extra={"replica": replica.name, "had": info.weight_version, "weight_version": wanted[1]},
                )
                await self._update_one(replica, from_disk(*wanted))

    async def _pause_all(self, chosen: list[Replica], weight_version: str) -> list[Replica]:
        """Pause (retract) ``chosen`` together; those that cannot be reached are ejected. The rest."""
        paused = await asyncio.gather(*(r.client.pause("retract") for r in chosen), return_exceptions=True)
        for replica, error in zip(chosen, paused, strict=True):
            if isinstance(error, EngineError):
                replica.eject(f"unreachable during a weight update: {error}")
            elif isinstance(error, BaseException):
                raise error
        replicas = [r for r in chosen if r.healthy]
        if not replicas:
            raise EngineUnavailable(f"no replica could be reached to load {weight_version}")
        return replicas

    @staticmethod
    async def _check_versions(replicas: list[Replica], weight_version: str) -> None:
        infos = await asyncio.gather(*(r.client.refresh_model_info() for r in replicas))
        stale = [r.name for r, info in zip(replicas, infos, strict=True) if info.weight_version != weight_version]
        if stale:
            raise EngineError(f"{', '.join(stale)} did not end on {weight_version}", 400)

    async def _roll_back(self, replicas: list[Replica]) -> None:
        if self.target is None:
            return
        for replica in replicas:
            try:
                await self._update_one(replica, from_disk(*self.target))
            except EngineError as exc:  # it must not serve the refused version: out until readmitted
                replica.eject(f"could not roll back to {self.target[1]}: {exc}")

    @staticmethod
    async def _update_one(replica: Replica, load: Load) -> None:
        replica.draining = True
        try:
            await replica.client.pause("retract")
            try:
                await load(replica.client)
            finally:
                await replica.client.resume()
        finally:
            replica.draining = False
