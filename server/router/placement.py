"""Placement: which replica of a pool takes the next request (the policy over affinity.py's choices)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from server.engines.base import EngineError, EngineOverloaded, EngineUnavailable
from server.router.affinity import HashRing, pick_affine, pick_least_loaded, pick_round_robin
from server.router.config import PoolConfig
from server.router.replica import Replica


class Placement:
    """Affinity ring with bounded load for session requests; least-loaded or round-robin otherwise.

    The ring holds every replica (eligible or not), so only the sessions of a replica that leaves
    rotation move, and they come back when it returns.
    """

    def __init__(self, names: Sequence[str], config: PoolConfig) -> None:
        self.config = config
        self._order = list(names)
        self._ring = HashRing(self._order)
        self._turn = 0

    def choose(
        self,
        replicas: Iterable[Replica],
        session_key: str | None,
        *,
        exclude: set[str],
        failures: Sequence[EngineError] = (),
    ) -> Replica:
        """The replica for one attempt, never one in ``exclude`` (those tried already).

        Raises:
            EngineOverloaded: every replica left refused for a full queue.
            EngineUnavailable: no replica is left to try.
        """
        candidates = [r for r in replicas if r.name not in exclude]
        # Draining replicas queue requests until they resume: a last resort, never a refusal.
        usable = {r.name: r for r in [r for r in candidates if r.eligible] or [r for r in candidates if r.healthy]}
        if not usable:
            if failures and all(isinstance(f, EngineOverloaded) for f in failures):
                raise EngineOverloaded("every engine replica's queue is full; retry later")
            tried = f" after trying {', '.join(sorted(exclude))}" if exclude else ""
            last = f" (last error: {failures[-1]})" if failures else ""
            raise EngineUnavailable(f"no engine replica is available{tried}{last}")
        name = self._pick({name: r.in_flight for name, r in usable.items()}, session_key)
        if name is None:  # unreachable: usable is not empty
            raise EngineUnavailable("no engine replica is available")
        return usable[name]

    def _pick(self, loads: dict[str, int], session_key: str | None) -> str | None:
        config = self.config
        if config.policy == "affinity" and session_key:
            return pick_affine(self._ring, session_key, loads, config.load_factor, config.load_floor)
        if config.policy == "round_robin":
            self._turn += 1
            return pick_round_robin(loads, self._order, self._turn - 1)
        return pick_least_loaded(loads, self._order)
