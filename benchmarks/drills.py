"""Fault drills: real `tandem serve` processes under load from the official openai client, one fault
each, and a table of what the clients were told against what the database holds afterwards.

Every drill starts its own gateway (the tiny model, PostgreSQL reached through a TCP proxy the drill
can cut) with clients that chat (plain or streamed) and rate every answer they get:

- gateway-kill: SIGKILL the gateway mid-load and start it again on the same data folder.
- engine-kill: SIGKILL one of two managed `tandem engine` replicas mid-stream; the pool reroutes and
  restarts it. And once more as new weights roll out (POST /admin/weights): the pool must end on
  the new version, every replica serving it.
- postgres-down: the proxy refuses and cuts every PostgreSQL connection for ``fault_s``.
- disk-full: the journal's disk (a tmpfs of its own, so this needs root) fills up for ``fault_s``,
  then the filler is deleted.
- tenant flood: tenant B's chat latencies alone and while tenant A keeps many chats in flight (a
  table of its own: p50 and p99 of each, and the ratio of the p99s).

Columns: sent (chat and rating requests), acknowledged (answers received whole, ratings answered
201), lost (acknowledged but not in the database once the gateway has flushed), duplicated (a request
stored twice, a rating applied twice), non-2xx (errors and broken connections, by status), recovery
(from the end of the fault until clients are answered again and the database holds everything
acknowledged before it ended).

    .venv/bin/python -m benchmarks.drills              # full lengths, a fresh PostgreSQL database each
    .venv/bin/python -m benchmarks.drills --fault-s 4  # about the CI tier's lengths (tests/e2e/test_drills.py)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url

from benchmarks.common import console, free_port, model_path, percentile, tenant_key, wait_until_answering
from benchmarks.drill import postgres_database
from storage.models import Completion, FeedbackEvent
from tests.fixtures.small_disk import fill, small_disk
from tests.fixtures.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
ADMIN_KEY = "drill-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "drill"  # the name the drills' gateways serve the tiny model under


@dataclass
class Ledger:
    """What the clients were told, from every client thread."""

    tag: str  # in every prompt of this drill, so the audit finds its rows in a shared database
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    completions: dict[str, float] = field(default_factory=dict)  # id -> when it was acknowledged
    feedback: dict[str, float] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)

    def acknowledged_before(self, moment: float) -> tuple[set[str], set[str]]:
        with self.lock:
            return (
                {i for i, t in self.completions.items() if t <= moment},
                {i for i, t in self.feedback.items() if t <= moment},
            )

    def answered_after(self, moment: float) -> bool:
        with self.lock:
            return any(t > moment for t in self.completions.values())


@dataclass(frozen=True)
class Audit:
    lost: int
    duplicated: int


@dataclass(frozen=True)
class Row:
    drill: str
    sent: int
    acknowledged: int
    lost: int
    duplicated: int
    failures: dict[str, int]
    recovery_s: float | None

    def cells(self) -> list[str]:
        failed = sum(self.failures.values())
        detail = ", ".join(f"{n} x {kind}" for kind, n in sorted(self.failures.items()))
        recovery = "not recovered" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        return [
            self.drill,
            str(self.sent),
            str(self.acknowledged),
            str(self.lost),
            str(self.duplicated),
            f"{failed} ({detail})" if failed else "0",
            recovery,
        ]


HEADER = ["drill", "sent", "acknowledged", "lost", "duplicated", "non-2xx", "recovery"]


class Gateway:
    """`tandem serve` of the tiny model on a fixed port, so clients find it again after a restart."""

    def __init__(self, data_dir: Path, database_url: str, model: str | None = None, **settings: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self._env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TANDEM_DATA_DIR": str(data_dir),
            "TANDEM_DATABASE_URL": database_url,
            "TANDEM_MODEL": model or str(model_path("tiny")),
            "TANDEM_SERVED_MODEL_NAME": MODEL,
            "TANDEM_PORT": str(self.port),
            "TANDEM_LEARNER": "off",
            "TANDEM_TORCH_THREADS": "1",
            "TANDEM_LOG_LEVEL": "WARNING",
            "TANDEM_ADMIN_KEY": ADMIN_KEY,
            **{f"TANDEM_{name.upper()}": value for name, value in settings.items()},
        }
        # A tenant key: the database may hold keys already (a shared one), and then nothing is keyless.
        self.key = tenant_key(database_url)
        self._process: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}-gateway.log"  # outside the data folder: it may be full

    def start(self) -> None:
        with self.log.open("ab") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "serve"], env=self._env, stdout=out, stderr=out, cwd=ROOT
            )
        models = urllib.request.Request(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {self.key}"})
        wait_until_answering(self._process, models, self.log, what="tandem serve", timeout_s=120)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def replicas(self) -> list[dict[str, Any]]:
        """GET /admin/engines: each replica's health, weights and load."""
        listed = httpx.get(f"{self.url}/admin/engines", headers=ADMIN, timeout=5)
        listed.raise_for_status()
        return list(listed.json()["data"])

    def admin(self, method: str, path: str, body: dict[str, Any]) -> int:
        """An admin request's status."""
        return httpx.request(method, f"{self.url}{path}", json=body, headers=ADMIN, timeout=120).status_code

    def both_replicas_healthy(self) -> bool:
        return len(self.engine_processes()) == 2 and all(r["healthy"] for r in self.replicas())

    def wait_for_replicas(self) -> None:
        """Until both managed replicas are healthy (the gateway answers once one is up)."""
        deadline = time.monotonic() + 120
        while not self.both_replicas_healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two engine replicas did not both become healthy; log: {self.log}")
            time.sleep(0.5)

    def busiest_replica(self) -> psutil.Process:
        """The managed engine process serving the most requests (routing may favour one), taken at a
        moment it serves some: a kill then cuts streams mid-way."""
        deadline = time.monotonic() + 10
        while True:
            busiest = max(self.replicas(), key=lambda replica: replica["in_flight"])
            if busiest["in_flight"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return self.replica_process(busiest["id"])

    def replica_process(self, replica_id: str) -> psutil.Process:
        """The managed engine process behind ``replica_id`` (its URL: the port names it)."""
        port = replica_id.rsplit(":", 1)[1]
        return next(child for child in self.engine_processes() if port in child.cmdline())

    def engine_processes(self) -> list[psutil.Process]:
        """The live `tandem engine` processes the gateway manages."""
        engines = []
        for child in psutil.Process(self.pid).children():
            with contextlib.suppress(psutil.Error):  # one that just died
                if child.status() != psutil.STATUS_ZOMBIE and "engine" in child.cmdline():
                    engines.append(child)
        return engines

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=30)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=60)


class Load:
    """``clients`` threads, each chatting (streamed or not) and rating every answer it gets, until stopped."""

    def __init__(
        self, gateway: Gateway, ledger: Ledger, clients: int, stream: bool, max_tokens: int = MAX_TOKENS
    ) -> None:
        self._gateway = gateway
        self._max_tokens = max_tokens
        self._ledger = ledger
        self._stream = stream
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _client(self, index: int) -> None:
        client = openai.OpenAI(base_url=f"{self._gateway.url}/v1", api_key=self._gateway.key, max_retries=0, timeout=30)
        turn = 0
        while not self._stop.is_set():
            turn += 1
            completion_id = self._count(self._chat, client, f"{self._ledger.tag} {index}-{turn}")
            if completion_id is None:
                continue
            with self._ledger.lock:
                self._ledger.completions[completion_id] = time.monotonic()
            if (rating := self._count(self._rate, client, completion_id)) is not None:
                with self._ledger.lock:
                    self._ledger.feedback[rating] = time.monotonic()

    def _count(
        self, request: Callable[[openai.OpenAI, str], str | None], client: openai.OpenAI, arg: str
    ) -> str | None:
        """Send one request; count it as sent, and as failed (by status) unless it gave an id."""
        with self._ledger.lock:
            self._ledger.sent += 1
        failure = "incomplete stream"
        try:
            if (answer := request(client, arg)) is not None:
                return answer
        except openai.APIStatusError as exc:
            failure = str(exc.status_code)
        except (openai.APIError, httpx.HTTPError):
            failure = "connection"
        with self._ledger.lock:
            self._ledger.failures[failure] += 1
        time.sleep(0.25 if failure == "connection" else 0.05)  # a gateway that is down refuses at once
        return None

    @staticmethod
    def _rate(client: openai.OpenAI, completion_id: str) -> str:
        body = {"completion_id": completion_id, "rating": "up"}
        return str(client.post("/feedback", cast_to=httpx.Response, body=body).json()["id"])

    def _chat(self, client: openai.OpenAI, prompt: str) -> str | None:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
        if not self._stream:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=self._max_tokens).id
        finished, completion_id = False, None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=self._max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},  # every stream runs its full length
        )
        for chunk in stream:
            completion_id = chunk.id
            finished = finished or any(c.finish_reason for c in chunk.choices)
        return completion_id if finished else None  # only a stream that finished is an answer


def audit(database_url: str, ledger: Ledger, completions: set[str], feedback: set[str]) -> Audit:
    """Which of ``completions`` and ``feedback`` are not stored, and how many of the drill's requests
    or ratings are stored more than once."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            stored = connection.execute(select(Completion.id, Completion.request_messages)).all()
            events = connection.execute(select(FeedbackEvent.id, FeedbackEvent.completion_id)).all()
    finally:
        engine.dispose()
    prompts = Counter(
        str(messages[-1].get("content")) for _, messages in stored if ledger.tag in str(messages[-1].get("content"))
    )
    drill_ids = {completion_id for completion_id, messages in stored if ledger.tag in str(messages[-1].get("content"))}
    ratings = Counter(completion_id for _, completion_id in events if completion_id in drill_ids)
    lost = len(completions - drill_ids) + len(feedback - {event_id for event_id, _ in events})
    duplicated = sum(n - 1 for n in prompts.values()) + sum(n - 1 for n in ratings.values())
    return Audit(lost, duplicated)


def recovery_seconds(
    database_url: str,
    ledger: Ledger,
    fault_ended: float,
    timeout_s: float,
    repaired: Callable[[], bool] = lambda: True,
) -> float | None:
    """Seconds from ``fault_ended`` until a client is answered again, everything acknowledged before
    it is stored and ``repaired`` holds; None if that does not happen within ``timeout_s``."""
    before = ledger.acknowledged_before(fault_ended)
    while time.monotonic() - fault_ended < timeout_s:
        if ledger.answered_after(fault_ended) and audit(database_url, ledger, *before).lost == 0 and repaired():
            return time.monotonic() - fault_ended
        time.sleep(0.2)
    return None


def final_row(drill: str, database_url: str, ledger: Ledger, recovery_s: float | None) -> Row:
    """The drill's row once the load has stopped: everything acknowledged must be stored (the gateway
    flushes its journal within seconds; the audit waits up to 30 s for it)."""
    completions, feedback = ledger.acknowledged_before(time.monotonic())
    deadline = time.monotonic() + 30
    result = audit(database_url, ledger, completions, feedback)
    while result.lost and time.monotonic() < deadline:
        time.sleep(0.5)
        result = audit(database_url, ledger, completions, feedback)
    return Row(
        drill,
        ledger.sent,
        len(completions) + len(feedback),
        result.lost,
        result.duplicated,
        dict(ledger.failures),
        recovery_s,
    )


@contextlib.contextmanager
def proxied(database_url: str) -> Iterator[tuple[str, TcpProxy]]:
    """``database_url`` reached through a TCP proxy the drill can cut."""
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.start()
    try:
        yield url.set(port=proxy.port).render_as_string(hide_password=False), proxy
    finally:
        proxy.stop()


@dataclass(frozen=True)
class DrillConfig:
    database_url: str
    workdir: Path
    clients: int = 4
    fault_s: float = 20.0
    steady_s: float = 5.0  # load before and after each fault
    recovery_timeout_s: float = 60.0


@dataclass(frozen=True)
class Fault:
    """What a drill does to the running system, under load: ``inject`` breaks something and returns
    once it is mended (its end is when recovery is timed from); ``repaired``: what else must hold,
    beyond answers and stored records, before it counts as recovered."""

    inject: Callable[[], None]
    repaired: Callable[[], bool] = lambda: True


def drill(
    config: DrillConfig,
    name: str,
    gateway: Gateway,
    url: str,
    ledger: Ledger,
    fault: Fault,
    *,
    stream: bool = False,
    max_tokens: int = MAX_TOKENS,
    ready: Callable[[], None] = lambda: None,
) -> Row:
    """Start ``gateway``, wait for ``ready``, load it, inject ``fault`` between two steady spells,
    stop it and audit: the drill's row."""
    gateway.start()
    try:
        ready()
        with Load(gateway, ledger, config.clients, stream, max_tokens):
            time.sleep(config.steady_s)
            fault.inject()
            ended = time.monotonic()
            recovery = recovery_seconds(url, ledger, ended, config.recovery_timeout_s, fault.repaired)
            time.sleep(config.steady_s)
        return final_row(name, url, ledger, recovery)
    finally:
        gateway.stop()


def gateway_kill(config: DrillConfig, stream: bool) -> Row:
    ledger = Ledger(f"drill-{secrets.token_hex(4)}")
    with proxied(config.database_url) as (url, _):
        gateway = Gateway(config.workdir / f"kill-{ledger.tag}", url)

        def kill_and_restart() -> None:
            gateway.kill()
            gateway.start()  # replays its journal

        name = "gateway-kill, " + ("streamed" if stream else "plain")
        return drill(config, name, gateway, url, ledger, Fault(kill_and_restart), stream=stream)


def postgres_down(config: DrillConfig) -> Row:
    ledger = Ledger(f"drill-{secrets.token_hex(4)}")
    with proxied(config.database_url) as (url, proxy):
        gateway = Gateway(config.workdir / f"pg-{ledger.tag}", url)

        def outage() -> None:
            proxy.stop()
            time.sleep(config.fault_s)
            proxy.start()

        return drill(config, f"postgres-down {config.fault_s:.0f} s", gateway, url, ledger, Fault(outage))


@contextlib.contextmanager
def two_replica_gateway(config: DrillConfig, ledger: Ledger) -> Iterator[tuple[Gateway, str]]:
    """A gateway (not started) managing two `tandem engine` replicas of the tiny model, and its
    database URL through a proxy."""
    data_dir = config.workdir / f"engine-{ledger.tag}"
    data_dir.mkdir(parents=True)
    engines = data_dir / "engines.toml"
    engines.write_text(
        f"""[[groups]]
name = "tiny"
engine = "tandem"
device = "cpu"
model_path = "{model_path("tiny")}"
replicas = 2
base_port = {free_port()}
port_stride = 7
env = {{ TANDEM_TORCH_THREADS = "1", TANDEM_LOG_LEVEL = "WARNING" }}
"""
    )
    with proxied(config.database_url) as (url, _):
        # A 2 s probe: a shorter one can time out on a busy engine on 2 cores and eject a healthy replica.
        yield Gateway(data_dir, url, engine="sglang", engine_config=str(engines), health_interval_s="2"), url


def engine_kill(config: DrillConfig) -> Row:
    """SIGKILL one of two managed engine replicas under streamed load; recovered once the pool has
    restarted it and every replica is healthy again."""
    ledger = Ledger(f"drill-{secrets.token_hex(4)}")
    with two_replica_gateway(config, ledger) as (gateway, url):
        killed: list[psutil.Process] = []

        def kill_busiest() -> None:
            killed.append(gateway.busiest_replica())
            os.killpg(killed[0].pid, signal.SIGKILL)

        def restarted() -> bool:  # another process in the victim's place, every replica healthy
            return killed[0] not in gateway.engine_processes() and gateway.both_replicas_healthy()

        # 512-token streams: the kill cuts some mid-way (errors the clients see, never lost answers).
        fault = Fault(kill_busiest, restarted)
        name = "engine replica SIGKILL, streamed"
        return drill(
            config, name, gateway, url, ledger, fault, stream=True, max_tokens=512, ready=gateway.wait_for_replicas
        )


def engine_kill_mid_update(config: DrillConfig) -> Row:
    """SIGKILL a replica and at once roll new weights out (POST /admin/weights), under streamed load:
    the rolling update meets a replica that died before the pool's probes noticed. Recovered once the
    pool has restarted it and every replica is healthy and serves the pool's weights.

    (Killing it inside its own load window, which lasts milliseconds for the tiny model, could not be
    timed reliably from outside; this order always has the update in progress while it is dead.)"""
    ledger = Ledger(f"drill-{secrets.token_hex(4)}")
    answers: list[int] = []
    killed: list[psutil.Process] = []
    with two_replica_gateway(config, ledger) as (gateway, url):

        def kill_and_update() -> None:
            killed.append(gateway.busiest_replica())
            os.killpg(killed[0].pid, signal.SIGKILL)
            body = {"model_path": str(model_path("tiny")), "weight_version": f"{ledger.tag}-v2"}
            answers.append(gateway.admin("POST", "/admin/weights", body))

        def one_version() -> bool:  # the victim replaced, every replica healthy on the pool's new weights
            serving = httpx.get(f"{gateway.url}/admin/weights", headers=ADMIN, timeout=5).json()["weight_version"]
            listed = gateway.replicas()
            return (
                serving == f"{ledger.tag}-v2"
                and killed[0] not in gateway.engine_processes()
                and len(listed) == 2
                and all(r["healthy"] and r["weight_version"] == serving for r in listed)
            )

        name = "engine replica SIGKILL during a weight update"
        fault = Fault(kill_and_update, one_version)
        row = drill(
            config, name, gateway, url, ledger, fault, stream=True, max_tokens=512, ready=gateway.wait_for_replicas
        )
    return dataclasses.replace(row, drill=f"{name} (update answered {answers[0] if answers else 'nothing'})")


def disk_full(config: DrillConfig) -> Row:
    ledger = Ledger(f"drill-{secrets.token_hex(4)}")
    data_dir = config.workdir / f"disk-{ledger.tag}"
    with small_disk(data_dir / "journal") as journal, proxied(config.database_url) as (url, _):

        def full() -> None:
            filler = fill(journal)
            time.sleep(config.fault_s)
            filler.unlink()

        return drill(config, f"disk-full {config.fault_s:.0f} s", Gateway(data_dir, url), url, ledger, Fault(full))


@dataclass(frozen=True)
class Flood:
    """Tenant B's chat latencies alone and while tenant A floods the gateway."""

    alone: list[float]
    during: list[float]
    flood_answered: int
    flood_failures: dict[str, int]
    b_failures: int

    @property
    def p99_ratio(self) -> float:
        return percentile(self.during, 99) / percentile(self.alone, 99)

    def cells(self) -> list[str]:
        refused = ", ".join(f"{n} x {kind}" for kind, n in sorted(self.flood_failures.items())) or "none"
        return [
            f"{percentile(self.alone, 50):.3f} / {percentile(self.alone, 99):.3f} s ({len(self.alone)})",
            f"{percentile(self.during, 50):.3f} / {percentile(self.during, 99):.3f} s ({len(self.during)})",
            f"{self.p99_ratio:.2f}x",
            str(self.b_failures),
            f"{self.flood_answered} answered, refused: {refused}",
        ]


FLOOD_HEADER = ["tenant B alone: p50 / p99", "while A floods: p50 / p99", "p99 ratio", "B failed", "tenant A"]


def tenant_flood(config: DrillConfig, flooders: int = 64, flood_tokens: int = 64, model: str = "tiny") -> Flood:
    """Tenant B chats one request after another (8 tokens) for ``steady_s`` alone, then for as long
    again while tenant A keeps ``flooders`` chats of ``flood_tokens`` tokens in flight (each ignoring
    EOS, so every one runs its full length). Plain chats: 64 streaming clients in this process would
    take the two cores' CPU the gateway needs."""
    with proxied(config.database_url) as (url, _):
        gateway = Gateway(config.workdir / f"flood-{secrets.token_hex(4)}", url, model=str(model_path(model)))
        flooder_key = tenant_key(url, tenant="drill-flooder")
        gateway.start()
        try:
            b = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key, max_retries=0, timeout=120)
            alone, b_failures = _timed_chats(b, config.steady_s)
            stop = threading.Event()
            answered: list[int] = []
            failures: Counter[str] = Counter()

            def flood() -> None:
                a = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=flooder_key, max_retries=0, timeout=300)
                messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "go on"}]
                while not stop.is_set():
                    try:
                        a.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=flood_tokens, extra_body={"ignore_eos": True}
                        )
                        answered.append(1)
                    except openai.APIStatusError as exc:
                        failures[str(exc.status_code)] += 1
                        time.sleep(0.05)
                    except (openai.APIError, httpx.HTTPError):
                        failures["connection"] += 1

            threads = [threading.Thread(target=flood, daemon=True) for _ in range(flooders)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)  # the flood fills the batch and the queue
            during, failed_during = _timed_chats(b, config.steady_s)
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
            return Flood(alone, during, len(answered), dict(failures), b_failures + failed_during)
        finally:
            gateway.stop()


def _timed_chats(client: openai.OpenAI, seconds: float, at_least: int = 20) -> tuple[list[float], int]:
    """Seconds of each of one client's 8-token chats, one after another, for ``seconds`` and at least
    ``at_least`` chats; and how many failed."""
    latencies: list[float] = []
    failed = 0
    ends = time.monotonic() + seconds
    while time.monotonic() < ends or len(latencies) < at_least:
        started = time.monotonic()
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=MAX_TOKENS
            )
        except openai.APIError:
            failed += 1
            continue
        latencies.append(time.monotonic() - started)
    return latencies, failed


def run_all(config: DrillConfig) -> list[Row]:
    drills: list[tuple[str, Callable[[], Row]]] = [
        ("gateway SIGKILL, plain", lambda: gateway_kill(config, stream=False)),
        ("gateway SIGKILL, streamed", lambda: gateway_kill(config, stream=True)),
        ("engine replica SIGKILL", lambda: engine_kill(config)),
        ("engine replica SIGKILL during a weight update", lambda: engine_kill_mid_update(config)),
        ("PostgreSQL unreachable", lambda: postgres_down(config)),
        ("journal disk full", lambda: disk_full(config)),
    ]
    rows = []
    for title, drill in drills:
        console.print(f"drill: {title} ...")
        rows.append(drill())
        console.print("  " + " | ".join(rows[-1].cells()))
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients, each chatting and rating")
    parser.add_argument("--fault-s", type=float, default=20.0, help="how long each fault lasts")
    parser.add_argument("--steady-s", type=float, default=10.0, help="load before and after each fault")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-drills"))
    parser.add_argument("--flood-model", default="smollm2-135m-instruct", help="the tenant flood's model")
    parser.add_argument("--flooders", type=int, default=64, help="tenant A's chats in flight")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    with postgres_database() as database_url:
        config = DrillConfig(database_url, args.workdir, args.clients, args.fault_s, args.steady_s)
        rows = run_all(config)
        console.print(f"drill: tenant flood ({args.flooders} chats in flight, {args.flood_model}) ...")
        flood = tenant_flood(config, args.flooders, model=args.flood_model)
    print(markdown(HEADER, [row.cells() for row in rows]))
    print()
    print(markdown(FLOOD_HEADER, [flood.cells()]))
    lost = sum(row.lost + row.duplicated for row in rows)
    console.print(f"{len(rows)} drills: {lost} records lost or duplicated in all")
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    main()
