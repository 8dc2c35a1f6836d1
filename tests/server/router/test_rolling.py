"""RollingUpdater and HealthMonitor on their own, over two real `tandem engine` servers: admission sets
the pool's weights, a roll pauses one replica at a time, a load together pauses them all and rolls
every one back when any ends elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.engines.base import EngineError
from server.engines.sglang_client import SGLangClient
from server.router.config import PoolConfig
from server.router.health import HealthMonitor
from server.router.replica import Replica
from server.router.rolling import RollingUpdater, from_disk

CONFIG = PoolConfig(health_interval_s=3600, health_timeout_s=30)  # no probe rounds during a test


@pytest.fixture
async def replicas(engine_urls: list[str]) -> AsyncIterator[dict[str, Replica]]:
    replicas = {url: Replica(url, SGLangClient(url)) for url in engine_urls}
    yield replicas
    for replica in replicas.values():
        await replica.client.close()


@pytest.fixture
async def updater(replicas: dict[str, Replica]) -> AsyncIterator[RollingUpdater]:
    updater = RollingUpdater(replicas)
    monitor = HealthMonitor(replicas, CONFIG, updater)
    await monitor.start(30)
    yield updater
    await monitor.close()


def versions(replicas: dict[str, Replica]) -> set[str]:
    return {r.client.model_info().weight_version for r in replicas.values()}


async def test_admission_takes_the_first_replicas_weights_as_the_pools(
    replicas: dict[str, Replica], updater: RollingUpdater, tiny_model: Path
) -> None:
    assert updater.target == (str(tiny_model), "default")
    assert all(r.healthy and not r.ejected.is_set() for r in replicas.values())


async def test_a_roll_pauses_one_replica_at_a_time(
    replicas: dict[str, Replica], updater: RollingUpdater, tiny_model: Path, perturbed_model: Path
) -> None:
    seen: list[tuple[str, list[str]]] = []

    async def load(client: SGLangClient) -> None:
        seen.append((client.replica, [r.name for r in replicas.values() if r.draining]))
        await from_disk(str(perturbed_model), "v2")(client)

    try:
        await updater.roll(str(perturbed_model), "v2", load)
        assert seen == [(name, [name]) for name in replicas]  # each alone, in order
        assert updater.target == (str(perturbed_model), "v2")
        assert versions(replicas) == {"v2"}
        assert not any(r.draining for r in replicas.values())
    finally:
        await updater.roll(str(tiny_model), "default", from_disk(str(tiny_model), "default"))


async def test_a_load_together_that_leaves_one_replica_behind_rolls_all_back(
    replicas: dict[str, Replica], updater: RollingUpdater, tiny_model: Path, perturbed_model: Path
) -> None:
    paused: list[list[str]] = []

    async def only_the_first(clients: list[SGLangClient]) -> None:
        paused.append([r.name for r in replicas.values() if r.draining])
        await clients[0].update_weights(str(perturbed_model), "v-together")

    with pytest.raises(EngineError, match="did not end on v-together"):
        await updater.update_together(str(perturbed_model), "v-together", only_the_first)
    assert paused == [list(replicas)]  # all paused together
    assert updater.target == (str(tiny_model), "default")
    assert versions(replicas) == {"default"}
    assert all(r.healthy and not r.draining for r in replicas.values())


def version_of(replicas: dict[str, Replica], name: str) -> str:
    return replicas[name].client.model_info().weight_version


async def test_a_split_serves_the_candidate_on_part_of_the_pool_until_it_ends(
    replicas: dict[str, Replica], updater: RollingUpdater, tiny_model: Path, perturbed_model: Path
) -> None:
    first, second = list(replicas)
    assert updater.serving("v-canary") is None  # not split: any replica serves
    split = await updater.start_split(str(perturbed_model), "v-canary", replicas=5)  # at most all but one
    assert split.replicas == {second} and updater.split == split
    assert (version_of(replicas, first), version_of(replicas, second)) == ("default", "v-canary")
    assert updater.serving("v-canary") == {second} and updater.serving(None) == {first}
    assert updater.target == (str(tiny_model), "default")

    # A replica of the split that returns to rotation gets the candidate again, not the pool's weights.
    await replicas[second].client.update_weights(str(tiny_model), "default")
    await updater.sync(replicas[second])
    assert version_of(replicas, second) == "v-canary"

    assert await updater.end_split(promote=False) == split
    assert versions(replicas) == {"default"} and updater.split is None
    with pytest.raises(EngineError, match="no base canary"):
        await updater.end_split(promote=True)

    await updater.start_split(str(perturbed_model), "v-canary", replicas=1)
    await updater.end_split(promote=True)
    assert versions(replicas) == {"v-canary"} and updater.target == (str(perturbed_model), "v-canary")
    await updater.roll(str(tiny_model), "default", from_disk(str(tiny_model), "default"))


async def test_a_roll_ends_a_split_and_a_refused_candidate_leaves_none(
    replicas: dict[str, Replica], updater: RollingUpdater, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    await updater.start_split(str(perturbed_model), "v-canary", replicas=1)
    await updater.roll(str(tiny_model), "v-rolled", from_disk(str(tiny_model), "v-rolled"))
    assert updater.split is None and versions(replicas) == {"v-rolled"}
    with pytest.raises(EngineError, match="refused"):
        await updater.start_split(str(tmp_path / "missing"), "v-bad", replicas=1)
    assert updater.split is None and versions(replicas) == {"v-rolled"}
    await updater.roll(str(tiny_model), "default", from_disk(str(tiny_model), "default"))


async def test_a_split_needs_two_replicas_in_rotation(
    replicas: dict[str, Replica], updater: RollingUpdater, perturbed_model: Path
) -> None:
    first = next(iter(replicas.values()))
    first.eject("a test")
    try:
        with pytest.raises(EngineError, match="two or more") as refused:
            await updater.start_split(str(perturbed_model), "v-canary", replicas=1)
        assert refused.value.status == 409 and updater.split is None
    finally:
        first.admit()
