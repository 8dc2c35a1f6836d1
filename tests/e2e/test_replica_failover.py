"""Managed `tandem engine` replicas: auto-restart on the pool's weights, and a replica SIGKILLed under load."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from sqlalchemy import create_engine, text

from server.app import create_app
from server.cache_scope import cache_salt, engine_session_key
from server.engine_factory import open_engine
from server.router.affinity import HashRing
from server.router.pool import EnginePool
from storage.tenants import DEFAULT_TENANT_ID
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import gateway_settings
from tests.support.polling import async_wait_until, wait_until
from tests.support.uvicorn_thread import free_port, serve_in_thread

# The restart test probes often. The load test needs no probes (failed requests eject the killed
# replica at once), and a 0.5 s probe of a busy engine on 2 cores can time out and eject a healthy one.
INTERVAL = 0.5
LOAD_INTERVAL = 5.0


def engine_config(tmp_path: Path, replicas: int) -> Path:
    path = tmp_path / "engines.toml"
    path.write_text(
        f"""
[[groups]]
name = "tiny"
engine = "tandem"
device = "cpu"
model_path = "{tiny_model_path()}"
replicas = {replicas}
base_port = {free_port()}
port_stride = 7
env = {{ TANDEM_TORCH_THREADS = "1", TANDEM_LOG_LEVEL = "WARNING" }}
"""
    )
    return path


def managed_settings(tmp_path: Path, replicas: int, interval: float = INTERVAL) -> object:
    return gateway_settings(
        tmp_path,
        tiny_model_path(),
        engine="sglang",
        engine_config=engine_config(tmp_path, replicas),
        health_interval_s=interval,
        healthy_after=2,
        engine_stall_timeout_s=10,
        engine_start_timeout_s=180,
    )


def kill(pool: EnginePool, index: int) -> str:
    assert pool.supervisor is not None
    server = pool.supervisor.servers[index]
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    return server.launch.url


async def test_a_killed_replica_is_restarted_and_serves_the_pools_weights(tmp_path: Path) -> None:
    settings = managed_settings(tmp_path, replicas=2)
    new_weights = perturb_weights(tiny_model_path(), tmp_path / "v2")
    pool = await open_engine(settings)  # type: ignore[arg-type]
    assert isinstance(pool, EnginePool)
    try:
        await async_wait_until(
            lambda: all(r.healthy for r in pool.replicas.values()), timeout_s=120, what="every replica is healthy"
        )
        victim = kill(pool, 0)
        await async_wait_until(
            lambda: not pool.replicas[victim].healthy,
            timeout_s=2 * INTERVAL + 3,  # two probes, and a loaded event loop's lag
            what="the killed replica is ejected",
        )
        await pool.update_weights(str(new_weights), "v2")  # the survivor only
        await async_wait_until(
            lambda: pool.replicas[victim].healthy, timeout_s=120, what="the restarted replica is readmitted"
        )
        assert pool.supervisor is not None and pool.supervisor.servers[0].starts == 2
        replica = pool.replicas[victim]
        assert replica.client.model_info().weight_version == "v2"
        assert replica.client.model_info().model_path == str(new_weights)
    finally:
        await pool.close()
    assert all(not s.running for s in pool.supervisor.servers)


@dataclass
class Outcomes:
    completed: list[str] = field(default_factory=list)  # completion ids
    stream_errors: list[tuple[str, int]] = field(default_factory=list)  # (completion id, chunks before the error)
    other: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def managed_gateway(tmp_path: Path) -> Iterator[tuple[str, EnginePool, Path]]:
    settings = managed_settings(tmp_path, replicas=3, interval=LOAD_INTERVAL)
    app = create_app(settings)  # type: ignore[arg-type]
    with serve_in_thread(app, startup_timeout_s=180) as url:
        pool = app.state.chat.engine
        wait_until(
            lambda: all(r.healthy for r in pool.replicas.values()), timeout_s=120, what="every replica is healthy"
        )
        yield url, pool, tmp_path


def test_killing_a_replica_under_load_loses_only_its_streams_and_logs_everything_once(
    managed_gateway: tuple[str, EnginePool, Path],
) -> None:
    url, pool, data_dir = managed_gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    outcomes = Outcomes()
    stop = threading.Event()

    def user(i: int, session: str) -> None:
        turn = 0
        while not stop.is_set():
            stream = (i + turn) % 2 == 0
            messages = [{"role": "user", "content": f"user {i} turn {turn}"}]
            extra = {"extra_body": {"ignore_eos": True}, "extra_headers": {"X-Session-Id": session}}
            try:
                if stream:
                    chunks, completion_id = 0, ""
                    reply = client.chat.completions.create(
                        model=model, messages=messages, max_tokens=200, stream=True, **extra
                    )
                    try:
                        for chunk in reply:
                            completion_id = chunk.id
                            chunks += 1
                    except openai.APIError:
                        with outcomes.lock:
                            outcomes.stream_errors.append((completion_id, chunks))
                        continue
                    with outcomes.lock:
                        outcomes.completed.append(completion_id)
                else:
                    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=40, **extra)
                    assert answer.usage is not None and answer.usage.completion_tokens == 40
                    with outcomes.lock:
                        outcomes.completed.append(answer.id)
            except Exception as exc:  # anything else is a lost request
                with outcomes.lock:
                    outcomes.other.append(f"{'stream' if stream else 'plain'}: {exc!r}")
            turn += 1

    victim_url = pool.supervisor.servers[1].launch.url  # type: ignore[union-attr]
    # Ports differ per run and so does the ring: pick sessions homed on each replica, three apiece.
    ring = HashRing(list(pool.replicas))
    salt = cache_salt(DEFAULT_TENANT_ID)  # keyless: the engines see sessions inside the default tenant

    def home(session: str) -> str:
        return next(ring.walk(engine_session_key(salt, session) or ""))

    homed = {name: [k for k in (f"user-{i}" for i in range(300)) if home(k) == name][:3] for name in ring.walk("")}
    sessions = [key for keys in homed.values() for key in keys]
    # One long stream certainly under way on the victim when it dies.
    doomed_session = next(f"doomed-{i}" for i in range(100) if home(f"doomed-{i}") == victim_url)
    doomed = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a long story"}],
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-Id": doomed_session},
    )
    doomed_id = next(iter(doomed)).id
    users = [threading.Thread(target=user, args=(i, key), daemon=True) for i, key in enumerate(sessions)]
    for thread in users:
        thread.start()
    wait_until(lambda: pool.replicas[victim_url].in_flight >= 3, timeout_s=60, what="the victim serves 3 streams")
    kill(pool, 1)
    # A killed server's connection either breaks mid-read or closes cleanly early: both are errors.
    with pytest.raises(openai.APIError, match=r"failed during generate|ended the stream"):
        for _ in doomed:
            pass
    outcomes.stream_errors.append((doomed_id, 1))
    time.sleep(3)
    stop.set()
    for thread in users:
        thread.join(timeout=90)
        assert not thread.is_alive(), "a client hung"

    assert outcomes.other == []
    assert len(outcomes.completed) >= 9  # every client got answers around the kill
    assert all(chunks >= 1 for _, chunks in outcomes.stream_errors)  # only streams already under way failed
    expected = {cid: "ok" for cid in outcomes.completed} | {cid: "error" for cid, _ in outcomes.stream_errors}
    rows = _logged(data_dir, set(expected))
    ids = [cid for cid, _ in rows]
    assert len(ids) == len(set(ids))  # nothing logged twice
    assert {cid: status for cid, status in rows if cid in expected} == expected


def _logged(data_dir: Path, expected: set[str]) -> list[tuple[str, str]]:
    """(id, status) of every logged completion, once all of ``expected`` are in (batches land late)."""
    deadline = time.monotonic() + 15
    db = create_engine(f"sqlite:///{data_dir / 'tandem.db'}")
    try:
        while True:
            with db.connect() as connection:
                rows = [(r[0], r[1]) for r in connection.execute(text("SELECT id, status FROM completions"))]
            if expected <= {cid for cid, _ in rows} or time.monotonic() > deadline:
                return rows
            time.sleep(0.3)
    finally:
        db.dispose()
