"""EnginePool over three real `tandem engine` servers, each behind a TCP proxy the tests can break."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from transformers import AutoConfig, AutoModelForCausalLM

from server.engines.base import (
    AdapterRef,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    SamplingParams,
    TokenChunk,
)
from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from server.router.affinity import HashRing
from server.router.pool import EnginePool, PoolConfig
from tests.fixtures.tcp_proxy import TcpProxy
from tests.server.engines.helpers import greedy, greedy_reference
from tests.server.engines.test_local_lora import make_adapter
from tests.support.polling import async_wait_until
from tests.support.uvicorn_thread import serve_in_thread

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]
# Health probes time out after one interval: 0.3 s, then 0.5 s, ejected healthy replicas (in-process
# servers sharing the GIL with generation) in loaded full-suite runs on the 2-core machine. Only the
# tests about probing probe often; the others keep probes out of the way (a failed request still
# ejects its replica at once).
INTERVAL = 1.0
CONFIG = PoolConfig(health_interval_s=INTERVAL, health_timeout_s=INTERVAL, healthy_after=2)
QUIET = PoolConfig(health_interval_s=120, health_timeout_s=120, healthy_after=2)
# A replica swapping weights is silent while it loads them: 1 s of silence failed a stream mid-swap in a
# loaded CI run. Only the stall test needs the short timeout.
STALL_S = 15.0


@dataclass
class Replicas:
    urls: list[str]
    proxies: dict[str, TcpProxy]


@pytest.fixture(scope="module")
def replicas(tiny_model: Path) -> Iterator[Replicas]:
    with ExitStack() as stack:
        proxies: dict[str, TcpProxy] = {}
        for _ in range(3):
            app = create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8))
            url = stack.enter_context(serve_in_thread(app))
            proxy = TcpProxy("127.0.0.1", int(url.rsplit(":", 1)[1]))
            proxy.start()
            stack.callback(proxy.stop)
            proxies[f"http://127.0.0.1:{proxy.port}"] = proxy
        yield Replicas(list(proxies), proxies)


@pytest.fixture
def stall_timeout_s() -> float:
    return STALL_S


@pytest.fixture
def pool_config() -> PoolConfig:
    return QUIET


@pytest.fixture
async def pool(replicas: Replicas, stall_timeout_s: float, pool_config: PoolConfig) -> AsyncIterator[EnginePool]:
    for proxy in replicas.proxies.values():  # undo what the last test broke
        proxy.fault = None
        proxy.stop()
        proxy.start()
    pool = await EnginePool.open(replicas.urls, pool_config, start_timeout_s=30, stall_timeout_s=stall_timeout_s)
    yield pool
    await pool.close()


async def run(pool: EnginePool, sampling: SamplingParams, **kwargs: object) -> list[TokenChunk]:
    return [chunk async for chunk in pool.generate(PROMPT, sampling, **kwargs)]  # type: ignore[arg-type]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def served_by(chunks: list[TokenChunk]) -> set[str | None]:
    return {c.replica for c in chunks}


def home_of(pool: EnginePool, session: str) -> str:
    return next(HashRing(list(pool.replicas)).walk(session))


async def test_a_session_stays_on_its_replica(pool: EnginePool) -> None:
    for session in ("alice", "bob", "carol", "dave"):
        for _ in range(3):
            chunks = await run(pool, greedy(3), session_key=session)
            assert served_by(chunks) == {home_of(pool, session)}


async def test_a_sessions_second_turn_reuses_its_prefix(pool: EnginePool) -> None:
    first = await run(pool, greedy(4), session_key="prefix-user")
    turn2 = PROMPT + tokens(first) + [2, 201, 1, 287, 201]
    chunks = [c async for c in pool.generate(turn2, greedy(2), session_key="prefix-user")]
    assert chunks[0].cached_tokens > len(PROMPT)


async def test_requests_without_a_session_go_to_the_least_loaded_replica(pool: EnginePool) -> None:
    first, second, _ = pool.replicas
    long_running = pool.generate(PROMPT, greedy(400))
    head = await anext(long_running)
    assert head.replica == first
    try:
        assert served_by(await run(pool, greedy(2))) == {second}
    finally:
        await long_running.aclose()
    assert served_by(await run(pool, greedy(2))) == {first}


@pytest.mark.parametrize("pool_config", [CONFIG])
async def test_a_dead_replica_leaves_within_two_intervals_and_returns_on_the_pools_weights(
    pool: EnginePool, replicas: Replicas, tiny_model: Path, perturbed_model: Path
) -> None:
    victim = replicas.urls[1]
    replicas.proxies[victim].stop()
    gone_after = await async_wait_until(
        lambda: not pool.replicas[victim].healthy, timeout_s=4 * INTERVAL, what="the dead replica is ejected"
    )
    assert gone_after <= 2 * INTERVAL + 1.0  # two probes, and a loaded event loop's lag
    assert await pool.health()
    assert victim not in {c.replica for _ in range(4) for c in await run(pool, greedy(1))}

    await pool.update_weights(str(perturbed_model), "v2")  # reaches the two live replicas only
    try:
        replicas.proxies[victim].start()
        back_after = await async_wait_until(
            lambda: pool.replicas[victim].healthy, timeout_s=60, what="the replica is readmitted"
        )
        assert back_after >= INTERVAL  # not on the first passed probe
        assert pool.replicas[victim].client.model_info().weight_version == "v2"
        session = next(f"s{i}" for i in range(100) if home_of(pool, f"s{i}") == victim)
        chunks = await run(pool, greedy(8), session_key=session)
        assert served_by(chunks) == {victim}
        assert {c.weight_version for c in chunks} == {"v2"}
        assert tokens(chunks) == greedy_reference(perturbed_model, PROMPT, 8)
    finally:
        await pool.update_weights(str(tiny_model), "default")


async def test_connection_refused_is_retried_on_another_replica(pool: EnginePool, replicas: Replicas) -> None:
    victim = replicas.urls[0]
    session = next(f"r{i}" for i in range(100) if home_of(pool, f"r{i}") == victim)
    replicas.proxies[victim].stop()  # before any probe notices
    chunks = await run(pool, greedy(5), session_key=session)
    assert tokens(chunks) and victim not in served_by(chunks)
    assert not pool.replicas[victim].healthy  # ejected at once, not at the next probe


@pytest.mark.parametrize("pool_config", [CONFIG])  # a one-piece reply has no stall timeout: the probe finds it
@pytest.mark.parametrize("stall_timeout_s", [2.0])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_stalled_replica_is_retried_before_anything_was_delivered(
    pool: EnginePool, replicas: Replicas, stream: bool
) -> None:
    victim = replicas.urls[2]
    session = next(f"t{i}" for i in range(100) if home_of(pool, f"t{i}") == victim)
    replicas.proxies[victim].fault = "stall"
    began = time.monotonic()
    chunks = await run(pool, greedy(5), session_key=session, stream=stream)
    assert len(tokens(chunks)) == 5 and victim not in served_by(chunks)
    assert time.monotonic() - began < 30  # the 2 s stall timeout, then another replica (not the 60 s default)


async def test_a_garbled_reply_is_retried_on_another_replica(pool: EnginePool, replicas: Replicas) -> None:
    victim = replicas.urls[1]
    session = next(f"g{i}" for i in range(100) if home_of(pool, f"g{i}") == victim)
    replicas.proxies[victim].fault = "garble"
    chunks = await run(pool, greedy(5), session_key=session)
    assert len(tokens(chunks)) == 5 and victim not in served_by(chunks)


async def test_a_stream_broken_after_its_first_chunk_raises_and_is_not_retried(
    pool: EnginePool, replicas: Replicas
) -> None:
    victim = replicas.urls[0]
    session = next(f"b{i}" for i in range(100) if home_of(pool, f"b{i}") == victim)
    stream = pool.generate(PROMPT, greedy(500), session_key=session)
    first = await anext(stream)
    assert first.replica == victim
    replicas.proxies[victim].stop()
    with pytest.raises(EngineError):
        async with asyncio.timeout(10):
            async for chunk in stream:
                assert chunk.replica == victim


async def test_a_buffered_request_survives_its_replica_dying_mid_generation(
    pool: EnginePool, replicas: Replicas, tiny_model: Path
) -> None:
    victim = replicas.urls[2]
    session = next(f"d{i}" for i in range(100) if home_of(pool, f"d{i}") == victim)
    task = asyncio.create_task(run(pool, greedy(300), session_key=session, stream=False))
    await async_wait_until(lambda: pool.replicas[victim].in_flight == 1, timeout_s=30, what="the request is running")
    await asyncio.sleep(0.2)  # mid-generation
    replicas.proxies[victim].stop()
    chunks = await task
    assert victim not in served_by(chunks)
    assert tokens(chunks) == greedy_reference(tiny_model, PROMPT, 300)


async def test_every_replica_failing_is_unavailable(pool: EnginePool, replicas: Replicas) -> None:
    for proxy in replicas.proxies.values():
        proxy.stop()
    with pytest.raises(EngineUnavailable, match="no engine replica is available after trying"):
        await run(pool, greedy(2))
    assert not await pool.health()


async def test_bad_requests_are_not_retried(pool: EnginePool) -> None:
    with pytest.raises(EngineError) as error:
        [c async for c in pool.generate([10**7], greedy(1))]
    assert error.value.status == 400
    assert all(r.healthy for r in pool.replicas.values())


async def test_rolling_weight_update_under_load_fails_nothing(
    pool: EnginePool, tiny_model: Path, perturbed_model: Path
) -> None:
    received: list[list[TokenChunk]] = [[] for _ in range(9)]

    async def client(i: int) -> None:
        async for chunk in pool.generate(PROMPT, greedy(200), session_key=f"load-{i}"):
            received[i].append(chunk)

    streams = [asyncio.create_task(client(i)) for i in range(len(received))]
    # Every request is generating when the update starts, so none can have run entirely before it.
    await async_wait_until(lambda: all(received), timeout_s=30, what="every stream has its first token")
    await pool.update_weights(str(perturbed_model), "v2")
    try:
        await asyncio.gather(*streams)
        versions = [[c.weight_version for c in chunks for _ in c.token_ids] for chunks in received]
        assert all(len(v) == 200 for v in versions)
        assert all(c.finish is None or c.finish.type == "length" for chunks in received for c in chunks)
        # A stream starts on the old weights and, once its replica is swapped, goes on under the new ones.
        order = ["default", "v2"]
        assert all(v[0] == "default" and v == sorted(v, key=order.index) for v in versions)
        # The swaps happened mid-request, not in a lull between requests.
        assert any(set(v) == {"default", "v2"} for v in versions), [sorted(set(v)) for v in versions]
        assert {r.client.model_info().weight_version for r in pool.replicas.values()} == {"v2"}
        assert pool.target == (str(perturbed_model), "v2")
    finally:
        await pool.update_weights(str(tiny_model), "default")


async def test_a_replica_serving_other_weights_is_brought_to_the_pools_before_admission(
    replicas: Replicas, tiny_model: Path, perturbed_model: Path
) -> None:
    odd_one = replicas.urls[2]
    outsider = await EnginePool.open([odd_one], CONFIG)
    await outsider.update_weights(str(perturbed_model), "stray")
    await outsider.close()
    pool = await EnginePool.open(replicas.urls, CONFIG)
    try:
        assert pool.target == (str(tiny_model), "default")
        assert pool.replicas[odd_one].client.model_info().weight_version == "default"
    finally:
        await pool.close()


def misbehaving_engine(reply: bytes, seen: list[dict[str, object]] | None = None) -> FastAPI:
    """A server that looks healthy but answers /generate with ``reply`` (and notes each request)."""
    app = FastAPI()

    @app.get("/model_info")
    async def model_info() -> dict[str, str]:
        return {"model_path": "/nowhere", "weight_version": "default"}

    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        if seen is not None:
            seen.append({"headers": dict(request.headers), "body": await request.json()})
        return Response(reply, media_type="text/event-stream")

    return app


@pytest.mark.parametrize(
    "reply",
    [b"data: {not json\n\n", b'data: {"meta_info": {}}\n\n', b'data: {"output_ids": [1], "meta_info": 7}\n\n', b""],
)
async def test_malformed_engine_replies_are_retried_on_a_good_replica(replicas: Replicas, reply: bytes) -> None:
    with serve_in_thread(misbehaving_engine(reply)) as bad:
        pool = await EnginePool.open([bad, replicas.urls[0]], CONFIG)
        try:
            chunks = await run(pool, greedy(3))  # least-loaded tries the first (bad) replica first
            assert served_by(chunks) == {replicas.urls[0]} and len(tokens(chunks)) == 3
        finally:
            await pool.close()


async def test_the_session_key_is_forwarded_for_an_external_router() -> None:
    seen: list[dict[str, object]] = []
    final = b'data: {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}\n\n'
    with serve_in_thread(misbehaving_engine(final, seen)) as router_url:
        pool = await EnginePool.open([router_url], CONFIG)
        try:
            assert tokens(await run(pool, greedy(1), session_key="user-42")) == [5]
        finally:
            await pool.close()
    (request,) = seen
    assert request["headers"]["x-smg-routing-key"] == "user-42"  # type: ignore[index]
    assert request["body"]["routing_key"] == "user-42"  # type: ignore[index]


async def test_full_queues_everywhere_are_429_not_503(tiny_model: Path) -> None:
    def small_engine() -> FastAPI:
        return create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1, max_queued_requests=1))

    with serve_in_thread(small_engine()) as one, serve_in_thread(small_engine()) as two:
        pool = await EnginePool.open([one, two], CONFIG)
        busy = [pool.generate(PROMPT, greedy(1000)) for _ in range(2)]
        try:
            assert {(await anext(stream)).replica for stream in busy} == {one, two}
            with pytest.raises(EngineOverloaded):
                await run(pool, greedy(1))
            assert all(r.healthy for r in pool.replicas.values())  # full is not sick
        finally:
            for stream in busy:
                await stream.aclose()
            await pool.close()


async def test_a_refused_checkpoint_leaves_every_replica_on_the_old_weights(
    pool: EnginePool, tiny_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(EngineError, match="refused"):
        await pool.update_weights(str(broken), "v-broken")
    assert pool.target == (str(tiny_model), "default")
    assert all(r.healthy for r in pool.replicas.values())
    assert {r.client.model_info().weight_version for r in pool.replicas.values()} == {"default"}
    for session in ("x", "y", "z"):
        assert {c.weight_version for c in await run(pool, greedy(2), session_key=session)} == {"default"}


def narrower_model(tiny_model: Path, out: Path) -> Path:
    """The tiny model's tokenizer with a narrower MLP: the same checkpoints do not fit it."""
    config = AutoConfig.from_pretrained(tiny_model)
    config.intermediate_size //= 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


async def test_a_checkpoint_refused_midway_rolls_the_updated_replicas_back(
    replicas: Replicas, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    narrow = narrower_model(tiny_model, tmp_path / "narrow")
    app = create_engine_app(lambda: LocalEngine.open(narrow, torch_threads=1))
    with serve_in_thread(app) as misfit:
        pool = await EnginePool.open([replicas.urls[0], misfit], CONFIG)
        try:
            with pytest.raises(EngineError, match=f"{misfit} refused"):
                await pool.update_weights(str(perturbed_model), "v2")
            first = pool.replicas[replicas.urls[0]].client.model_info()
            assert (first.model_path, first.weight_version) == (str(tiny_model), "default")  # rolled back
            assert pool.target == (str(tiny_model), "default")
            assert all(r.healthy for r in pool.replicas.values())
        finally:
            await pool.close()


async def test_two_gateways_send_a_session_to_the_same_replica(replicas: Replicas) -> None:
    """No shared state: each gateway process has its own pool, and they still agree."""
    # Health is not under test here: probes rare enough that a loaded machine cannot eject a replica
    # from one pool only (CI saw that with 1 s probes).
    steady = PoolConfig(health_interval_s=120, health_timeout_s=120)
    first = await EnginePool.open(replicas.urls, steady)
    second = await EnginePool.open(list(reversed(replicas.urls)), steady)
    try:
        for session in [f"shared-{i}" for i in range(12)]:
            here = served_by(await run(first, greedy(1), session_key=session))
            there = served_by(await run(second, greedy(1), session_key=session))
            assert here == there and len(here) == 1
        assert len({r.in_flight for r in first.replicas.values()}) == 1  # all back to 0
    finally:
        await first.close()
        await second.close()


async def test_a_scopes_adapter_versions_keep_to_the_scopes_replica(
    pool: EnginePool, tiny_model: Path, tmp_path: Path
) -> None:
    """Placement by the adapter's scope, not its version: a new version lands where the old one was
    resident, and only that replica loads it."""
    first = make_adapter(tiny_model, tmp_path / "v1", seed=1, targets=["q_proj", "v_proj"])
    second = make_adapter(tiny_model, tmp_path / "v2", seed=2, targets=["q_proj", "v_proj"])
    home = home_of(pool, "acme/user/ann")
    for folder in (first, second, first):
        adapter = AdapterRef(folder.name, str(folder), scope="acme/user/ann")
        chunks = await run(pool, greedy(3), session_key="some-session", adapter=adapter)
        assert served_by(chunks) == {home} and {c.adapter for c in chunks} == {folder.name}
    loaded = {name: replica.client.adapters.loaded for name, replica in pool.replicas.items()}
    assert loaded == {name: (["v2", "v1"] if name == home else []) for name in pool.replicas}  # v1 used last
