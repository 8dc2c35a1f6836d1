"""Where a request goes: consistent hashing with bounded load, least-loaded, or round-robin.

Pure functions of the replica list and the loads this gateway sees, so every gateway process makes
the same choice for the same session without sharing any state (hashes are stable across processes:
blake2b, never Python's salted ``hash``).

Bounded load (Mirrokni, Thorup, Zadimoghaddam, 2018): walk the ring from the key's point and take
the first eligible replica whose load stays within ``ceil((1 + eps) * (total + 1) / n)``. A session
keeps its replica until that replica is ineligible or over the bound, then moves to the next one on
the ring, and only the keys of a replica that leaves move at all.

The bound never drops below ``floor`` requests: an engine batches its requests, so a handful more
in flight costs little, while a session that moves loses its cached prefix there and on its return
(measured in BENCHMARKS.md: at 8 sessions in flight over 3 replicas the relative bound alone moved
13-18 % of turns).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence

VIRTUAL_NODES = 64  # points per replica: smooths the share of keys each replica gets


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over replica names (all of them, eligible or not)."""

    def __init__(self, names: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        points = sorted((_point(f"{name}#{v}"), name) for name in names for v in range(virtual_nodes))
        self._hashes = [p for p, _ in points]
        self._names = [n for _, n in points]
        self._count = len(names)

    def walk(self, key: str) -> Iterator[str]:
        """Every replica once, in ring order from the key's point."""
        if not self._names:
            return
        start = bisect.bisect(self._hashes, _point(key))
        seen: set[str] = set()
        for i in range(len(self._names)):
            name = self._names[(start + i) % len(self._names)]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == self._count:
                    return


def load_bound(total_load: int, replicas: int, eps: float, floor: int = 0) -> int:
    """The most requests one replica may hold once the new one is placed."""
    return max(math.ceil((1 + eps) * (total_load + 1) / replicas), floor)


def pick_affine(ring: HashRing, key: str, loads: Mapping[str, int], eps: float, floor: int = 0) -> str | None:
    """The session's replica among ``loads`` (eligible replicas -> in-flight requests)."""
    if not loads:
        return None
    bound = load_bound(sum(loads.values()), len(loads), eps, floor)
    for name in ring.walk(key):
        if name in loads and loads[name] + 1 <= bound:
            return name
    return None  # unreachable: the least-loaded replica is always within the bound


def pick_least_loaded(loads: Mapping[str, int], order: Sequence[str]) -> str | None:
    """Fewest in-flight requests; ties go to the earlier replica in ``order``."""
    candidates = [name for name in order if name in loads]
    return min(candidates, key=lambda name: loads[name]) if candidates else None


def pick_round_robin(loads: Mapping[str, int], order: Sequence[str], turn: int) -> str | None:
    """The ``turn``-th eligible replica, cyclically."""
    candidates = [name for name in order if name in loads]
    return candidates[turn % len(candidates)] if candidates else None
