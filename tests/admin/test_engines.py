"""/admin/engines over a pool of three real `tandem engine` servers (the tiny model, in threads), and
on the in-process local engine: a drained replica under load fails nothing and gets no new request;
undrained, its sessions come back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from server.cache_scope import cache_salt, engine_session_key
from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from server.router.affinity import HashRing
from storage.audit import list_admin_actions
from tests.admin.test_metrics import parse
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.open_streams import streams_in_progress
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import serve_in_thread

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SESSIONS = [f"user-{i}" for i in range(12)]


def engine_key(session: str) -> str:
    """The key the router places a session of tenant acme by (server.cache_scope)."""
    return engine_session_key(cache_salt("acme"), session) or ""


@pytest.fixture(scope="module")
def model() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="module")
def pool_gateway(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                serve_in_thread(create_engine_app(lambda: LocalEngine.open(model, torch_threads=1, max_batch_size=8)))
            )
            for _ in range(3)
        ]
        settings = gateway_settings(
            tmp_path_factory.mktemp("pool"),
            model,
            admin_key=ADMIN_KEY,
            engine="sglang",
            engine_urls=urls,
            health_interval_s=5.0,  # probes of busy in-process engines: a short one ejects healthy replicas
            healthy_after=1,
        )
        yield stack.enter_context(run_gateway(settings, tenants=("acme",)))


@pytest.fixture(scope="module")
def local_gateway(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("local"), model, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def engines(gateway: Gateway) -> dict[str, dict]:
    response = httpx.get(f"{gateway.url}/admin/engines", headers=ADMIN)
    assert response.status_code == 200, response.text
    return {replica["id"]: replica for replica in response.json()["data"]}


def post(gateway: Gateway, replica: str, verb: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/admin/engines/{replica}/{verb}", headers=ADMIN)


def completions_by_replica(gateway: Gateway) -> dict[str, float]:
    samples, _ = parse(httpx.get(f"{gateway.url}/metrics", headers=ADMIN).text)
    return {dict(labels)["replica"]: v for (name, labels), v in samples.items() if name == "tandem_completions_total"}


class SessionLoad:
    """Threads looping over chat sessions (non-streaming and streaming) until stopped; counts failures."""

    def __init__(self, gateway: Gateway, threads: int = 4) -> None:
        self.client = gateway.client(gateway.keys["acme"])
        self.model = gateway.model
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def _loop(self, worker: int) -> None:
        turn = 0
        while not self._stop.is_set():
            session = SESSIONS[(worker + 4 * turn) % len(SESSIONS)]
            turn += 1
            try:
                messages = [{"role": "user", "content": f"hello from {session}"}]
                if turn % 2:
                    self.client.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=12, user=session
                    )
                else:
                    stream = self.client.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=12, user=session, stream=True
                    )
                    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
                    assert finish in (["stop"], ["length"]), finish
                with self._lock:
                    self.completed += 1
            except Exception as exc:  # every failure is counted, none may happen
                with self._lock:
                    self.failures.append(repr(exc))

    def wait_for(self, more: int, timeout_s: float = 60.0) -> None:
        target = self.completed + more
        try:
            wait_until(lambda: self.completed >= target, timeout_s=timeout_s, what=f"{more} more requests complete")
        except AssertionError as exc:  # the failures say why the load stalled
            raise AssertionError(f"{exc}; stalled at {self.completed}: {self.failures[:3]}") from None

    def __enter__(self) -> SessionLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def test_lists_every_replica_with_health_weights_and_load(pool_gateway: Gateway) -> None:
    replicas = engines(pool_gateway)
    assert len(replicas) == 3
    for name, replica in replicas.items():
        assert replica == {
            "id": name,
            "object": "engine_replica",
            "healthy": True,
            "drained": False,
            "updating_weights": False,
            "weight_version": "default",
            "in_flight": 0,
            "cache_hit_ratio": replica["cache_hit_ratio"],
        }
    client = pool_gateway.client(pool_gateway.keys["acme"])
    for _ in range(2):  # the same prompt twice in one session: the second finds its prefix cached
        client.chat.completions.create(
            model=pool_gateway.model, messages=[{"role": "user", "content": "cache me"}], max_tokens=2, user="cacher"
        )
    home = next(HashRing(list(replicas)).walk(engine_key("cacher")))
    ratio = engines(pool_gateway)[home]["cache_hit_ratio"]
    samples, _ = parse(httpx.get(f"{pool_gateway.url}/metrics", headers=ADMIN).text)
    tokens = {
        name: samples[(name, (("replica", home),))]
        for name in ("tandem_cached_tokens_total", "tandem_prompt_tokens_total")
    }
    assert 0 < ratio == tokens["tandem_cached_tokens_total"] / tokens["tandem_prompt_tokens_total"] <= 1
    one = httpx.get(f"{pool_gateway.url}/admin/engines/{home}", headers=ADMIN)
    assert one.status_code == 200 and one.json()["id"] == home


def test_draining_under_load_fails_nothing_and_undraining_returns_traffic(pool_gateway: Gateway) -> None:
    names = list(engines(pool_gateway))
    ring = HashRing(names)
    victim = max(names, key=lambda n: sum(next(ring.walk(engine_key(s))) == n for s in SESSIONS))  # the busiest home
    with SessionLoad(pool_gateway) as load:
        load.wait_for(12)
        drained = post(pool_gateway, victim, "drain")
        assert drained.status_code == 200, drained.text
        assert drained.json()["drained"] is True
        wait_until(
            lambda: not engines(pool_gateway)[victim]["in_flight"],
            timeout_s=30,
            what="the drained replica's requests finish there",
            interval_s=0.01,
        )
        served_before = completions_by_replica(pool_gateway).get(victim, 0)
        assert served_before > 0  # it was serving its sessions until the drain
        load.wait_for(30)
        assert engines(pool_gateway)[victim]["in_flight"] == 0
        assert completions_by_replica(pool_gateway).get(victim, 0) == served_before  # no new request reached it
        assert all(r["healthy"] for r in engines(pool_gateway).values())

        undrained = post(pool_gateway, victim, "undrain")
        assert undrained.status_code == 200 and undrained.json()["drained"] is False
        load.wait_for(30)
        returned = completions_by_replica(pool_gateway)[victim] - served_before
    assert load.failures == []
    assert returned > 0  # its sessions came back
    with pool_gateway.sessions()() as session:
        actions = [(a.action, a.target) for a in list_admin_actions(session, limit=100)]
    assert ("engine.drain", victim) in actions and ("engine.undrain", victim) in actions


def test_the_last_replica_in_rotation_cannot_be_drained(pool_gateway: Gateway) -> None:
    first, second, third = engines(pool_gateway)
    try:
        assert post(pool_gateway, first, "drain").status_code == 200
        assert post(pool_gateway, second, "drain").status_code == 200
        refused = post(pool_gateway, third, "drain")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "cannot_drain"
        assert not engines(pool_gateway)[third]["drained"]
    finally:
        for name in (first, second):
            assert post(pool_gateway, name, "undrain").status_code == 200
    assert not any(r["drained"] for r in engines(pool_gateway).values())


@pytest.mark.parametrize(("method", "suffix"), [("GET", ""), ("POST", "/drain"), ("POST", "/undrain")])
def test_an_unknown_replica_is_404(pool_gateway: Gateway, method: str, suffix: str) -> None:
    response = httpx.request(method, f"{pool_gateway.url}/admin/engines/http://nowhere:1{suffix}", headers=ADMIN)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "replica_not_found"


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/admin/engines"), ("GET", "/admin/engines/x"), ("POST", "/admin/engines/x/drain")]
)
def test_needs_the_admin_key(local_gateway: Gateway, method: str, path: str) -> None:
    assert httpx.request(method, f"{local_gateway.url}{path}").status_code == 401
    tenant = {"Authorization": f"Bearer {local_gateway.keys['acme']}"}
    forbidden = httpx.request(method, f"{local_gateway.url}{path}", headers=tenant)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "admin_required"


def test_the_local_engine_is_one_replica_that_cannot_be_drained(local_gateway: Gateway) -> None:
    replicas = engines(local_gateway)
    assert list(replicas) == ["local-0"]
    assert replicas["local-0"]["healthy"] is True
    served = httpx.get(f"{local_gateway.url}/admin/weights", headers=ADMIN).json()["weight_version"]
    assert replicas["local-0"]["weight_version"] == served  # another test of this module swaps weights
    assert replicas["local-0"]["in_flight"] == 0
    refused = post(local_gateway, "local-0", "drain")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "cannot_drain"
    assert post(local_gateway, "other", "drain").status_code == 404


def test_load_cache_hits_and_weight_version_follow_traffic_and_a_swap(local_gateway: Gateway, tmp_path: Path) -> None:
    before = engines(local_gateway)["local-0"]
    assert (before["in_flight"], before["cache_hit_ratio"], before["weight_version"]) == (0, None, "default")
    with streams_in_progress(local_gateway.url, local_gateway.keys["acme"], local_gateway.model, count=3):
        assert engines(local_gateway)["local-0"]["in_flight"] == 3
    client = local_gateway.client(local_gateway.keys["acme"])
    usages = [
        client.chat.completions.create(
            model=local_gateway.model, messages=[{"role": "user", "content": "cache me"}], max_tokens=2, user="cacher"
        ).usage
        for _ in range(2)
    ]
    model = perturb_weights(tiny_model_path(), tmp_path / "perturbed")
    swap = httpx.post(
        f"{local_gateway.url}/admin/weights",
        json={"model_path": str(model), "weight_version": "engines-v1"},
        headers=ADMIN,
        timeout=120,
    )
    assert swap.status_code == 200, swap.text

    after = engines(local_gateway)["local-0"]
    assert after["weight_version"] == "engines-v1"
    assert after["in_flight"] == 0  # the cancelled streams left the engine
    assert usages[1] is not None and usages[1].prompt_tokens_details is not None
    assert usages[1].prompt_tokens_details.cached_tokens  # the second turn found the first one's prefix
    assert 0 < after["cache_hit_ratio"] < 1
