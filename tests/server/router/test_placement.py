"""Placement over replicas whose state the tests set: affinity within the load bound, the policies,
draining replicas as a last resort, and the errors when nothing is left."""

from __future__ import annotations

import pytest

from server.engines.base import EngineOverloaded, EngineUnavailable
from server.engines.sglang_client import SGLangClient
from server.router.affinity import HashRing
from server.router.config import PoolConfig
from server.router.placement import Placement
from server.router.replica import Replica

NAMES = [f"http://127.0.0.1:{port}" for port in (9001, 9002, 9003)]


def replicas() -> dict[str, Replica]:
    # Clients that are never called: placement reads only what the pool knows of each replica.
    return {name: Replica(name, SGLangClient(name), healthy=True) for name in NAMES}


def test_a_session_goes_home_and_moves_along_the_ring_only_when_its_home_is_out() -> None:
    pool = replicas()
    placement = Placement(NAMES, PoolConfig())
    home, after = list(HashRing(NAMES).walk("session-a"))[:2]
    assert placement.choose(pool.values(), "session-a", exclude=set()).name == home
    pool[home].drained = True
    assert placement.choose(pool.values(), "session-a", exclude=set()).name == after
    assert placement.choose(pool.values(), "session-a", exclude={after}).name not in (home, after)


def test_a_session_leaves_its_home_only_beyond_the_load_bound() -> None:
    pool = replicas()
    placement = Placement(NAMES, PoolConfig(load_factor=0.25, load_floor=4))
    home = next(HashRing(NAMES).walk("session-b"))
    pool[home].in_flight = 3  # one more is 4: within the floor
    assert placement.choose(pool.values(), "session-b", exclude=set()).name == home
    pool[home].in_flight = 4
    assert placement.choose(pool.values(), "session-b", exclude=set()).name != home


def test_without_a_session_the_least_loaded_then_round_robin() -> None:
    pool = replicas()
    pool[NAMES[0]].in_flight = 2
    pool[NAMES[1]].in_flight = 1
    least = Placement(NAMES, PoolConfig(policy="least_loaded"))
    assert least.choose(pool.values(), "ignored", exclude=set()).name == NAMES[2]
    assert Placement(NAMES, PoolConfig()).choose(pool.values(), None, exclude=set()).name == NAMES[2]
    turns = Placement(NAMES, PoolConfig(policy="round_robin"))
    assert [turns.choose(pool.values(), None, exclude=set()).name for _ in range(4)] == [*NAMES, NAMES[0]]


def test_a_draining_replica_is_a_last_resort_and_an_unhealthy_one_never() -> None:
    pool = replicas()
    pool[NAMES[0]].draining = True
    pool[NAMES[1]].healthy = False
    placement = Placement(NAMES, PoolConfig())
    assert placement.choose(pool.values(), None, exclude=set()).name == NAMES[2]
    assert placement.choose(pool.values(), None, exclude={NAMES[2]}).name == NAMES[0]


def test_nothing_left_is_unavailable_or_overloaded_as_the_failures_say() -> None:
    pool = replicas()
    placement = Placement(NAMES, PoolConfig())
    with pytest.raises(EngineUnavailable, match="after trying"):
        placement.choose(pool.values(), "s", exclude=set(NAMES), failures=[EngineUnavailable("refused")])
    with pytest.raises(EngineOverloaded):
        placement.choose(pool.values(), "s", exclude=set(NAMES), failures=[EngineOverloaded("full")] * 3)
