"""Routing choices: consistent hashing with bounded load, least-loaded and round-robin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from server.router.affinity import HashRing, load_bound, pick_affine, pick_least_loaded, pick_round_robin

REPLICAS = ["http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"]
SESSIONS = [f"session-{i}" for i in range(600)]


def idle(names: list[str]) -> dict[str, int]:
    return dict.fromkeys(names, 0)


def test_walk_visits_every_replica_once_in_a_fixed_order() -> None:
    ring = HashRing(REPLICAS)
    for key in SESSIONS[:50]:
        order = list(ring.walk(key))
        assert sorted(order) == sorted(REPLICAS)
        assert order == list(HashRing(list(reversed(REPLICAS))).walk(key))  # list order does not matter


def test_sessions_spread_over_replicas() -> None:
    ring = HashRing(REPLICAS)
    counts = Counter(pick_affine(ring, key, idle(REPLICAS), 0.25) for key in SESSIONS)
    assert set(counts) == set(REPLICAS)
    assert min(counts.values()) > len(SESSIONS) / len(REPLICAS) * 0.6


def test_other_processes_make_the_same_choices() -> None:
    """Stable hashes (not Python's salted hash): a gateway with another hash seed agrees."""
    ring = HashRing(REPLICAS)
    here = [pick_affine(ring, key, idle(REPLICAS), 0.25) for key in SESSIONS[:100]]
    code = (
        "import json,sys; from server.router.affinity import HashRing, pick_affine; r=json.loads(sys.argv[1]); "
        "ring=HashRing(r); print(json.dumps([pick_affine(ring, f'session-{i}', dict.fromkeys(r, 0), 0.25) "
        "for i in range(100)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(REPLICAS)], env=env, capture_output=True, check=True)
    assert json.loads(out.stdout) == here


def test_a_leaving_replica_moves_only_its_own_sessions_to_their_next_on_the_ring() -> None:
    ring = HashRing(REPLICAS)
    before = {key: pick_affine(ring, key, idle(REPLICAS), 0.25) for key in SESSIONS}
    gone = REPLICAS[1]
    after = {key: pick_affine(ring, key, idle([r for r in REPLICAS if r != gone]), 0.25) for key in SESSIONS}
    for key in SESSIONS:
        if before[key] != gone:
            assert after[key] == before[key]
        else:
            assert after[key] == next(r for r in ring.walk(key) if r != gone)


def test_bounded_load_moves_a_session_off_an_overloaded_replica_deterministically() -> None:
    ring = HashRing(REPLICAS)
    key = SESSIONS[0]
    home, second, _ = ring.walk(key)
    # 9 in flight in all: the bound for the 10th request is ceil(1.25 * 10 / 3) = 5.
    assert load_bound(9, 3, 0.25) == 5
    loads = {home: 4, second: 3, REPLICAS[0] if REPLICAS[0] not in (home, second) else REPLICAS[2]: 2}
    assert pick_affine(ring, key, loads, 0.25) == home  # 4 + 1 <= 5: stays
    loads = {home: 5, second: 2, next(r for r in REPLICAS if r not in (home, second)): 2}
    assert pick_affine(ring, key, loads, 0.25) == second  # over the bound: the next one on the ring
    assert pick_affine(ring, key, {**loads, home: 1}, 0.25) == home  # back home once the load falls


def test_the_bound_always_leaves_a_replica() -> None:
    ring = HashRing(REPLICAS)
    for total in range(0, 40):
        loads = {REPLICAS[0]: total, REPLICAS[1]: 0, REPLICAS[2]: 0}
        assert pick_affine(ring, "k", loads, 0.01) is not None


def test_only_eligible_replicas_are_chosen() -> None:
    ring = HashRing(REPLICAS)
    eligible = {REPLICAS[2]: 7}
    assert {pick_affine(ring, key, eligible, 0.25) for key in SESSIONS[:30]} == {REPLICAS[2]}
    assert pick_affine(ring, "k", {}, 0.25) is None


def test_least_loaded_breaks_ties_by_list_order() -> None:
    assert pick_least_loaded({REPLICAS[0]: 2, REPLICAS[1]: 1, REPLICAS[2]: 1}, REPLICAS) == REPLICAS[1]
    assert pick_least_loaded({REPLICAS[2]: 0}, REPLICAS) == REPLICAS[2]
    assert pick_least_loaded({}, REPLICAS) is None


def test_round_robin_cycles_over_eligible_replicas() -> None:
    loads = {REPLICAS[0]: 9, REPLICAS[2]: 0}
    assert [pick_round_robin(loads, REPLICAS, turn) for turn in range(4)] == [REPLICAS[0], REPLICAS[2]] * 2


def test_duplicate_replica_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        HashRing([REPLICAS[0], REPLICAS[0]])


def test_below_the_floor_a_session_never_moves_for_load() -> None:
    ring = HashRing(REPLICAS)
    key = SESSIONS[0]
    home = next(ring.walk(key))
    loads = {name: (4 if name == home else 1) for name in REPLICAS}  # 4 of 6: over 1.25 x average
    assert pick_affine(ring, key, loads, 0.25) != home
    assert pick_affine(ring, key, loads, 0.25, floor=8) == home
    assert pick_affine(ring, key, {**loads, home: 8}, 0.25, floor=8) != home  # the floor is a bound too
    assert load_bound(100, 4, 0.25, floor=8) == 32  # at high load the relative bound rules
