"""The learner pool end to end: real `tandem worker` processes on the machine's Redis, and `tandem serve`
with its embedded worker on SQLite.

Each test has its own gateway (in-thread uvicorn, local engine, tiny model, SQLite) and its own Redis
key prefix, deleted afterwards, so runs in parallel do not meet. Timings come from settings: beat
every second, heartbeats every half second, a round stale after 3 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import torch

from learner.beat import DEFAULT_SCHEDULE
from learner.celery_app import LEARN, LearnerCelery, create_celery_app, send_learn
from learner.tasks import learn_now
from storage import (
    finish_round,
    get_round,
    heartbeat_round,
    last_watermark,
    list_adapters,
    list_rounds,
    list_versions,
    start_round,
)
from storage.audit import list_admin_actions
from storage.schedules import ScheduleView, list_firings, list_schedules
from tandem.settings import Settings
from tests.admin.test_metrics import parse
from tests.e2e.processes import start_tandem
from tests.e2e.test_learning_round import LEARNING_RATE, chat_and_rate
from tests.fixtures.tcp_proxy import TcpProxy
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.fault_plugins import HANG
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support import learner_queue
from tests.support.learner_queue import REDIS
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

TASK_TIMEOUT_S = 90


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    with learner_queue.redis_prefix() as prefix:
        yield prefix


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    (tmp_path / "gateway").mkdir()
    settings = gateway_settings(tmp_path / "gateway", tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("e2e",)) as gw:
        yield gw


def learner_env(gateway: Gateway, data_dir: Path, prefix: str, **overrides: str) -> dict[str, str]:
    """The environment of this test's workers (and the settings of its task sender)."""
    return {
        "TANDEM_DATA_DIR": str(data_dir),
        "TANDEM_DATABASE_URL": gateway.settings.resolved_database_url,
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_REDIS_URL": REDIS,
        "TANDEM_REDIS_KEY_PREFIX": prefix,
        "TANDEM_LEARN_LEARNING_RATE": str(LEARNING_RATE),
        "TANDEM_LEARN_THREADS": "1",
        "TANDEM_LEARN_CHECK_INTERVAL_S": "1",
        "TANDEM_LEARN_MIN_FEEDBACK": "3",
        "TANDEM_LEARN_MIN_INTERVAL_S": "0",
        "TANDEM_ROUND_HEARTBEAT_S": "0.5",
        "TANDEM_ROUND_STALE_TIMEOUT_S": "3",
        "TANDEM_CELERY_VISIBILITY_TIMEOUT_S": "2",
        "TANDEM_LOG_FORMAT": "console",
        "TANDEM_TORCH_THREADS": "1",
        # Every rating trains and every round rolls out: the evaluation gate has tests of its own.
        "TANDEM_EVAL_GATE": "off",
        **overrides,
    }


def settings_of(env: dict[str, str]) -> Settings:
    """The settings a worker started with ``env`` runs on."""
    return Settings.model_validate({name.removeprefix("TANDEM_").lower(): value for name, value in env.items()})


def sender(env: dict[str, str]) -> LearnerCelery:
    """A Celery app that sends tasks to the workers started with ``env``."""
    return create_celery_app(settings_of(env))


class Worker:
    """A `tandem worker` process leading its own process group (beat and training children included)."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "worker", "--server", args[0], *args[1:]],
                env={**os.environ, **env},
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        wait_until(
            lambda: " ready." in log.read_text() or self.popen.poll() is not None,
            timeout_s=60,
            what="the worker starts",
        )
        assert self.popen.poll() is None, log.read_text()[-3000:]

    def group(self) -> list[psutil.Process]:
        """Live processes of the worker's group (a killed child may linger as a zombie until reaped)."""
        return [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == self.popen.pid and _alive(p)]

    def kill_group(self) -> None:
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:  # nothing to keep: a warm shutdown would only cost seconds
            self.kill_group()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(env: dict[str, str], server: str, *args: str) -> Worker:
        worker = Worker(env, tmp_path / f"worker-{len(started)}.log", server, *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def beat_ticks(gateway: Gateway) -> float:
    """Ticks of beat so far: with a feedback schedule each asks the gateway what it serves
    (``GET /admin/weights``), which nothing else in these tests does while no round runs."""
    response = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    samples, _ = parse(response.text)
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "tandem_http_requests_total" and {("route", "/admin/weights"), ("method", "GET")} <= set(labels)
    )


def wait_for_two_beat_ticks(gateway: Gateway) -> None:
    """Return once a tick of beat has both begun after this call and ended: the first tick counted
    may have read the database before it was called, the second begins only after that one ended."""
    ticks = beat_ticks(gateway)
    wait_until(lambda: beat_ticks(gateway) >= ticks + 2, timeout_s=30, what="beat ticks twice more")


def weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/health", timeout=10).json()["weight_version"])


def test_learn_task_runs_a_round_and_the_server_serves_it(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    env = learner_env(gateway, tmp_path / "learner", redis_prefix)
    worker = workers(env, gateway.url)
    chat_and_rate(gateway, [("What is 2 + 2?", "up"), ("What is 2 + 2?", "down"), ("Say hi.", "up")])

    result: dict[str, Any] = sender(env).send_task(LEARN).get(timeout=TASK_TIMEOUT_S)

    assert result["status"] == "succeeded", result
    assert result["samples"] == 3 and result["watermark_from"] == 0 and result["watermark_to"] > 0
    assert set(result["seconds"]) == {"collect", "reward", "train", "export", "swap"}
    assert weight_version(gateway.url) == result["version_id"]
    client = gateway.client(gateway.keys["e2e"])
    reply = client.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}])
    assert reply.system_fingerprint == result["version_id"]
    with gateway.sessions()() as session:
        (round_row,) = list_rounds(session, model=gateway.model)
    assert round_row.trigger == "manual" and round_row.produced_version_id == result["version_id"]
    # Nothing new since: a second task ends "nothing to learn" and serving stays.
    again = sender(env).send_task(LEARN).get(timeout=TASK_TIMEOUT_S)
    assert again["status"] == "nothing_to_learn" and again["version_id"] is None
    assert again["reason"] == f"no new ratings since watermark {result['watermark_to']}"
    assert weight_version(gateway.url) == result["version_id"]
    logged = worker.log.read_text()
    assert "superuser privileges" not in logged  # Celery's root warning: one line of ours instead, as root
    assert ("runs as root" in logged) == (os.geteuid() == 0)


def test_the_default_schedule_waits_for_enough_feedback_and_the_interval(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    env = learner_env(gateway, tmp_path / "learner", redis_prefix, TANDEM_LEARN_MIN_INTERVAL_S="600")
    workers(env, gateway.url, "--beat")
    sessions = gateway.sessions()

    def default_schedule() -> ScheduleView | None:
        with sessions() as session:
            return next((s for s in list_schedules(session) if s.name == DEFAULT_SCHEDULE), None)

    wait_until(default_schedule, timeout_s=30, what="beat creates the default schedule")
    default = default_schedule()
    assert default is not None and (default.kind, default.min_feedback, default.interval_s) == ("feedback", 3, 600)
    with sessions() as session:
        (created,) = list_admin_actions(session, action="schedule.create")
    assert created.target == default.id and created.actor.startswith("beat:") and created.status_code == 201

    chat_and_rate(gateway, [("Name a colour.", "up"), ("Name a fruit.", "down")])
    wait_for_two_beat_ticks(gateway)  # a tick that saw the ratings, and must not fire with two of three
    with sessions() as session:
        assert list_rounds(session, model=gateway.model) == ()
        assert list_firings(session, schedule_id=default.id) == ()
    assert weight_version(gateway.url) == "default"

    chat_and_rate(gateway, [("Name a tree.", "up")])

    def finished() -> bool:  # the round is marked succeeded just after its new version starts serving
        with sessions() as session:
            return any(r.status != "running" for r in list_rounds(session, model=gateway.model))

    wait_until(finished, timeout_s=TASK_TIMEOUT_S, what="the schedule's round finishes")
    with sessions() as session:
        (round_row,) = list_rounds(session, model=gateway.model)
        (firing,) = list_firings(session, schedule_id=default.id)
    assert round_row.status == "succeeded" and round_row.trigger == "schedule" and round_row.schedule_id == default.id
    assert round_row.samples_trained == 3 and round_row.produced_version_id == weight_version(gateway.url)
    assert firing.slot == "feedback:0:0"

    # Enough feedback again, but the schedule fired less than its interval_s ago.
    chat_and_rate(gateway, [("One.", "up"), ("Two.", "down"), ("Three.", "up")])
    wait_for_two_beat_ticks(gateway)
    with sessions() as session:
        assert len(list_rounds(session, model=gateway.model)) == 1
        assert len(list_firings(session, schedule_id=default.id)) == 1


def test_a_schedules_round_settings_reach_its_round(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    env = learner_env(gateway, tmp_path / "learner", redis_prefix)
    workers(env, gateway.url)
    chat_and_rate(gateway, [("Is it raining?", "up"), ("Is it snowing?", "down")])
    app = sender(env)
    overrides = {"learning_rate": LEARNING_RATE / 2, "steps": 2}

    send_learn(app, task_id="scheduled-1", trigger="schedule", schedule_id="sched_x", round_settings=overrides)
    result = app.AsyncResult("scheduled-1").get(timeout=TASK_TIMEOUT_S)

    assert result["status"] == "succeeded", result
    with gateway.sessions()() as session:
        round_row = get_round(session, round_id=result["round_id"])
    assert (round_row.trigger, round_row.schedule_id) == ("schedule", "sched_x")
    assert round_row.config["learning_rate"] == LEARNING_RATE / 2 and round_row.config["num_steps"] == 2


def test_a_personal_schedule_trains_and_serves_each_users_adapter(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    env = learner_env(gateway, tmp_path / "learner", redis_prefix, TANDEM_ADAPTER_MIN_RATINGS="3")
    created = httpx.post(
        f"{gateway.url}/admin/schedules",
        json={"name": "personal", "kind": "feedback", "min_feedback": 3, "round_settings": {"scope": "personal"}},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert created.status_code == 201, created.text
    workers(env, gateway.url, "--beat")
    chat_and_rate(gateway, [("Name a river.", "up"), ("Name a lake.", "down"), ("Name a sea.", "up")], user="pat")

    def served_adapter(user: str) -> str | None:
        raw = gateway.client(gateway.keys["e2e"]).chat.completions.with_raw_response.create(
            model=gateway.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user=user
        )
        return raw.headers.get("x-tandem-adapter")

    wait_until(lambda: served_adapter("pat"), timeout_s=TASK_TIMEOUT_S, what="the schedule's personal round serves")
    with gateway.sessions()() as session:
        (adapter,) = list_adapters(session, model=gateway.model)
        (firing,) = list_firings(session, schedule_id=created.json()["id"])
        assert list_rounds(session, model=gateway.model) == ()  # no base round ran
    assert (adapter.scope_kind, adapter.scope, adapter.status, adapter.ratings) == ("user", "pat", "serving", 3)
    assert served_adapter("pat") == adapter.id and firing.slot == "feedback:0:0"
    assert served_adapter("someone-else") is None and weight_version(gateway.url) == "default"  # the base stays


def test_a_killed_workers_task_is_redelivered_and_its_round_recovered(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    env = learner_env(gateway, tmp_path / "learner", redis_prefix)
    chat_and_rate(gateway, [("Is water wet?", "up"), ("Is fire cold?", "down"), ("Is ice hot?", "down")])
    doomed = workers({**env, "TANDEM_LEARN_CUSTOM_LOSS_PATH": HANG}, gateway.url)
    task = sender(env).send_task(LEARN)

    def running() -> bool:
        with gateway.sessions()() as session:
            return bool(list_rounds(session, model=gateway.model, status="running"))

    wait_until(running, timeout_s=TASK_TIMEOUT_S, what="the doomed worker's round starts")
    # The worker and its training child.
    wait_until(lambda: len(doomed.group()) >= 2, timeout_s=30, what="the training child hangs")
    time.sleep(1)  # the training child is loading the model, past any chance of finishing
    doomed.kill_group()
    assert doomed.group() == []

    workers(env, gateway.url)  # picks the unacknowledged task up once its visibility timeout passed
    result = task.get(timeout=TASK_TIMEOUT_S)

    assert result["status"] == "succeeded", result
    with gateway.sessions()() as session:
        rounds = list_rounds(session, model=gateway.model)
        versions = list_versions(session, model=gateway.model)
        watermark = last_watermark(session, model=gateway.model)
    assert sorted(r.status for r in rounds) == ["failed", "succeeded"]
    failed = next(r for r in rounds if r.status == "failed")
    succeeded = next(r for r in rounds if r.status == "succeeded")
    assert "heart-beating" in (failed.error or "") and failed.watermark_to is None
    assert succeeded.id == result["round_id"] and succeeded.worker_id != failed.worker_id
    # The dead round consumed nothing: the re-run learns from all three ratings exactly once.
    assert succeeded.watermark_from == 0 and succeeded.samples_collected == 3 and succeeded.samples_trained == 3
    assert watermark == succeeded.watermark_to == result["watermark_to"]
    assert [v.id for v in versions] == [result["version_id"]]
    assert weight_version(gateway.url) == result["version_id"]


def test_a_redelivered_task_waits_out_a_dead_lock_holder_not_a_live_one(gateway: Gateway, tmp_path: Path) -> None:
    settings = settings_of(learner_env(gateway, tmp_path, ""))
    sessions = gateway.sessions()
    with sessions.begin() as session:
        live = start_round(session, model=gateway.model, worker_id="live-worker")
    beating = threading.Event()

    def heartbeat() -> None:
        while not beating.wait(0.2):
            with sessions.begin() as session:
                heartbeat_round(session, round_id=live.id)

    beater = threading.Thread(target=heartbeat, daemon=True)
    beater.start()
    try:
        started = time.monotonic()
        busy = learn_now(settings, server_url=gateway.url, admin_key=ADMIN_KEY)
        assert busy["status"] == "busy" and time.monotonic() - started < 3
    finally:
        beating.set()
        beater.join()
    with sessions.begin() as session:
        finish_round(session, round_id=live.id, status="failed", error="test")
        dead = start_round(session, model=gateway.model, worker_id="dead-worker")  # never beats

    started = time.monotonic()
    result = learn_now(settings, server_url=gateway.url, admin_key=ADMIN_KEY)
    waited = time.monotonic() - started
    assert result["status"] == "nothing_to_learn", result  # it ran, after the dead round went stale
    assert 2.5 < waited < 15, waited
    with sessions() as session:
        assert get_round(session, round_id=dead.id).status == "failed"
        assert get_round(session, round_id=result["round_id"]).status == "nothing_to_learn"


def test_worker_exits_2_when_the_broker_is_unreachable(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TANDEM_DATA_DIR": str(tmp_path),
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens on port 1
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "worker"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "cannot reach the broker redis://127.0.0.1:1/0" in done.stderr
    assert time.monotonic() - started < 30


def test_serve_learns_on_its_embedded_worker_with_zero_configuration(tmp_path: Path) -> None:
    env = {
        "TANDEM_MODEL": str(tiny_model_path()),
        "TANDEM_REDIS_URL": "",
        "TANDEM_LEARNER": "embedded",
        "TANDEM_LEARN_CHECK_INTERVAL_S": "1",
        "TANDEM_LEARN_MIN_FEEDBACK": "3",
        "TANDEM_LEARN_LEARNING_RATE": str(LEARNING_RATE),
        "TANDEM_LEARN_THREADS": "1",
        "TANDEM_LOG_FORMAT": "console",
    }
    serve = start_tandem(["serve"], data_dir=tmp_path, ready_path="/health", env=env)
    try:
        wait_until(lambda: psutil.Process(serve.popen.pid).children(), timeout_s=30, what="serve has its worker child")
        # Keyless, as in the quick start: the internal key of serve's worker must not end that.
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for question, rating in [("hello?", "up"), ("hi?", "down"), ("hey?", "up")]:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=6
            )
            client.post("/feedback", body={"completion_id": reply.id, "rating": rating}, cast_to=object)
        wait_until(
            lambda: weight_version(serve.url) != "default",
            timeout_s=TASK_TIMEOUT_S,
            what="a scheduled round rolls out",
        )
        assert httpx.get(f"{serve.url}/admin/weights").status_code == 401  # admin needs the key serve printed
        descendants = psutil.Process(serve.popen.pid).children(recursive=True)
        assert descendants
    finally:
        serve.stop()
    # uvicorn shuts down cleanly on SIGTERM, then re-raises it.
    assert serve.popen.returncode in (0, -signal.SIGTERM), serve.log.read_text()[-3000:]
    assert "learner worker child stopped" in serve.log.read_text()
    alive = [p for p in descendants if _alive(p)]
    assert alive == [], serve.log.read_text()[-3000:]


def test_redis_unreachable_mid_round_trains_once_and_leaves_serving_alone(
    gateway: Gateway, tmp_path: Path, redis_prefix: str, workers: Callable[..., Worker]
) -> None:
    """The drill: the worker's broker goes away (connections cut and refused) while its round trains."""
    proxy = TcpProxy("127.0.0.1", 6379)
    proxy.start()
    try:
        env = learner_env(gateway, tmp_path / "learner", redis_prefix)
        proxied = {**env, "TANDEM_REDIS_URL": REDIS.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")}
        chat_and_rate(gateway, [("Is snow white?", "up"), ("Is coal white?", "down"), ("Is milk white?", "up")])
        serving = weight_version(gateway.url)
        workers(proxied, gateway.url)
        sender(env).send_task(LEARN)  # straight to Redis: only the worker's connection is cut

        def rounds(status: str) -> list[Any]:
            with gateway.sessions()() as session:
                return list_rounds(session, model=gateway.model, status=status)

        wait_until(lambda: rounds("running"), timeout_s=TASK_TIMEOUT_S, what="the round starts")
        proxy.stop()
        client = gateway.client(gateway.keys["e2e"])
        answered_by = set()
        for _ in range(3):  # serving does not need the broker (the round may swap meanwhile: over HTTP)
            reply = client.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}])
            answered_by.add(reply.system_fingerprint)
        time.sleep(5)  # past the visibility timeout (2 s): the broker would redeliver an unacknowledged task
        proxy.start()

        wait_until(lambda: rounds("succeeded"), timeout_s=TASK_TIMEOUT_S, what="the round succeeds")
        time.sleep(6)  # time for a redelivered copy to run, and to find nothing left to learn
        with gateway.sessions()() as session:
            every = list_rounds(session, model=gateway.model)
            versions = list_versions(session, model=gateway.model)
        (done,) = [r for r in every if r.status == "succeeded"]
        assert {r.status for r in every} <= {"succeeded", "nothing_to_learn", "failed"}, every
        assert done.samples_trained == 3 and [v.id for v in versions] == [done.produced_version_id]
        assert weight_version(gateway.url) == done.produced_version_id
        assert answered_by <= {serving, done.produced_version_id}, answered_by
    finally:
        proxy.stop()
