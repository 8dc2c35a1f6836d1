"""The admin API for runs, model versions and the audit log, on a live gateway (tiny model, SQLite).

Real rounds (``learner.round.run_round``: real training in a child process, the real hot swap) make
the history the API reads; promote and rollback swap weights under streaming clients that may not
see a single failure; a hanging round is cancelled through the API and stops without serving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from learner.evaluation import EvalConfig
from learner.round import RoundConfig, RoundResult, run_round
from learner.round_config import default_train_config
from storage import get_round, list_versions, record_model_version, set_version_status
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.learner.fault_plugins import HANG
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.polling import wait_until
from tests.support.streaming_load import StreamingLoad

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACTOR = "admin:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12]
LEARNING_RATE = 1e-2  # the tiny model is stored in bf16: smaller updates round away on export


@dataclass
class History:
    """Two real rounds: the first trains v1 from the base weights, the second v2 from v1."""

    first: RoundResult
    second: RoundResult
    started: datetime


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("admin"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def round_config(gateway: Gateway, checkpoints: Path, **overrides: Any) -> RoundConfig:
    values: dict[str, Any] = {
        "server_url": gateway.url,
        "admin_key": ADMIN_KEY,
        "database_url": gateway.settings.resolved_database_url,
        "checkpoint_dir": checkpoints,
        "learning_rate": LEARNING_RATE,
        "num_threads": 1,
        "evaluation": EvalConfig(gate="off"),  # every round rolls out: the gate is tested in tests/e2e
        **overrides,
    }
    return RoundConfig(**values)


def chat_and_rate(gateway: Gateway, questions: list[str]) -> None:
    client = gateway.client(gateway.keys["acme"])
    last = ""
    for seed, question in enumerate(questions):
        reply = client.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": question}], max_tokens=6, seed=seed
        )
        client.post(
            "/feedback", body={"completion_id": reply.id, "rating": "up" if seed % 2 else "down"}, cast_to=object
        )
        last = reply.id
    client.get(f"/completions/{last}", cast_to=object)  # flushes the conversation log


@pytest.fixture(scope="module")
def history(gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> History:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    started = datetime.now(UTC)
    chat_and_rate(gateway, ["Say yes.", "Say no."])
    first = run_round(round_config(gateway, checkpoints))
    chat_and_rate(gateway, ["Name a fruit.", "Name a bird."])
    second = run_round(round_config(gateway, checkpoints))
    assert first.status == second.status == "succeeded", (first.error, second.error)
    return History(first, second, started)


def admin(gateway: Gateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=60, **kwargs)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def versions_of(gateway: Gateway) -> tuple[Any, ...]:
    # Closed at once: an open SQLite transaction holds the write lock (BEGIN IMMEDIATE).
    with gateway.sessions()() as session:
        return tuple(list_versions(session, model=gateway.model))


def error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["message"] and body["type"]
    if code is not None:
        assert body["code"] == code, body
    return body


def serving(gateway: Gateway) -> str:
    return ok(admin(gateway, "GET", "/admin/weights"))["weight_version"]


def audit(gateway: Gateway, action: str) -> list[dict[str, Any]]:
    return ok(admin(gateway, "GET", "/admin/audit", params={"action": action}))["data"]


ENDPOINTS = [
    ("GET", "/admin/runs"),
    ("GET", "/admin/runs/round-x"),
    ("POST", "/admin/runs/round-x/cancel"),
    ("GET", "/admin/models"),
    ("GET", "/admin/models/v-x"),
    ("POST", "/admin/models/v-x/promote"),
    ("POST", "/admin/models/v-x/rollback"),
    ("GET", "/admin/audit"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_admin_key_required(gateway: Gateway, method: str, path: str) -> None:
    url = f"{gateway.url}{path}"
    error(httpx.request(method, url), 401, "missing_api_key")
    error(httpx.request(method, url, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    tenant = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    error(httpx.request(method, url, headers=tenant), 403, "admin_required")


def test_runs_list_filter_page_and_detail(gateway: Gateway, history: History) -> None:
    first, second = history.first.round_id, history.second.round_id
    # Other tests of this module add rounds of their own (cancelled ones): only the order of these two is fixed.
    runs = ok(admin(gateway, "GET", "/admin/runs", params={"model": gateway.model}))
    assert [r["id"] for r in runs["data"] if r["id"] in (first, second)] == [second, first]
    assert runs["has_more"] is False
    listed = {r["id"]: r for r in runs["data"]}
    assert listed[second]["status"] == "succeeded" and listed[second]["trigger"] == "manual"

    paged: list[str] = []
    cursor: dict[str, Any] = {}
    while True:  # one round a page, newest first, each page's cursor leading to the next
        page = ok(
            admin(gateway, "GET", "/admin/runs", params={"limit": 1, "since": history.started.isoformat(), **cursor})
        )
        paged += [r["id"] for r in page["data"]]
        if not page["has_more"]:
            break
        assert page["next_before"] == paged[-1] and len(page["data"]) == 1
        cursor = {"before": page["next_before"]}
    assert paged == [r["id"] for r in runs["data"]] and paged[-1] == first

    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert ok(admin(gateway, "GET", "/admin/runs", params={"since": later}))["data"] == []
    assert ok(admin(gateway, "GET", "/admin/runs", params={"status": "failed", "trigger": "manual"}))["data"] == []
    assert ok(admin(gateway, "GET", "/admin/runs", params={"trigger": "schedule"}))["data"] == []
    assert ok(admin(gateway, "GET", "/admin/runs", params={"model": "other"}))["data"] == []

    detail = ok(admin(gateway, "GET", f"/admin/runs/{second}"))
    assert detail["status"] == "succeeded" and detail["produced_version_id"] == history.second.version_id
    assert detail["base_version_id"] == history.first.version_id
    assert detail["watermark"] == {"from": history.first.watermark_to, "to": history.second.watermark_to}
    assert detail["watermark"]["to"] > detail["watermark"]["from"] > 0
    assert set(detail["timings"]["stages_s"]) == {"collect", "reward", "train", "export", "swap"}
    assert detail["timings"]["duration_s"] > 0 and detail["config"]["learning_rate"] == LEARNING_RATE
    assert "loss" in detail["metrics"] and detail["error"] is None

    for params, param in (
        ({"status": "done"}, "status"),
        ({"trigger": "cron"}, "trigger"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-01T00:00:00"}, "since"),  # no timezone
        ({"limit": 0}, "limit"),
        ({"before": "round-unknown"}, "before"),
    ):
        assert error(admin(gateway, "GET", "/admin/runs", params=params), 400)["param"] == param
    error(admin(gateway, "GET", "/admin/runs/round-unknown"), 404, "round_not_found")


def test_versions_list_with_metrics_and_lineage(gateway: Gateway, history: History) -> None:
    v1, v2 = history.first.version_id, history.second.version_id
    versions = ok(admin(gateway, "GET", "/admin/models", params={"model": gateway.model}))["data"]
    by_id = {v["id"]: v for v in versions}
    assert by_id[v2]["status"] == "serving" and by_id[v1]["status"] == "retired"
    assert by_id[v2]["lineage"] == [v2, v1] and by_id[v1]["lineage"] == [v1]
    assert by_id[v2]["metrics"]["round_id"] == history.second.round_id and "loss" in by_id[v2]["metrics"]
    detail = ok(admin(gateway, "GET", f"/admin/models/{v2}"))
    assert detail["parent_id"] == v1 and [a["id"] for a in detail["ancestors"]] == [v1]
    assert ok(admin(gateway, "GET", "/admin/models", params={"status": "retired", "limit": 1}))["data"][0]["id"] == v1
    error(admin(gateway, "GET", "/admin/models", params={"status": "live"}), 400)
    error(admin(gateway, "GET", "/admin/models/v-unknown"), 404, "version_not_found")


def test_rollback_and_promote_swap_with_zero_failures(
    gateway: Gateway, history: History, tmp_path_factory: pytest.TempPathFactory
) -> None:
    v1, v2 = history.first.version_id, history.second.version_id
    assert v1 and v2 and serving(gateway) == v2
    # A candidate that was never served (as an evaluation gate would leave one), on other weights.
    perturbed = perturb_weights(tiny_model_path(), tmp_path_factory.mktemp("candidate") / "model")
    with gateway.sessions().begin() as session:
        record_model_version(
            session, version_id="cand-1", model=gateway.model, checkpoint_path=str(perturbed), parent_id=v2
        )
        record_model_version(session, version_id="bad-1", model=gateway.model, checkpoint_path=str(perturbed))
        set_version_status(session, version_id="bad-1", status="rejected", reason="eval: worse than serving")

    with StreamingLoad(gateway.client(gateway.keys["acme"]), gateway.model) as load:
        back = ok(admin(gateway, "POST", f"/admin/models/{v1}/rollback", json={"reason": "v2 regressed"}))
        assert back["weight_version"] == v1 and back["previous_version"] == v2
        wait_until(lambda: v1 in load.fingerprints, timeout_s=30, what="the clients see v1 before it goes again")
        forward = ok(admin(gateway, "POST", "/admin/models/cand-1/promote"))
        assert forward["weight_version"] == "cand-1" and forward["previous_version"] == v1
    assert load.failures == [] and load.completed > 0
    assert {v1, "cand-1"} <= load.fingerprints
    statuses = {v.id: v.status for v in versions_of(gateway)}
    assert statuses == {v1: "retired", v2: "retired", "cand-1": "serving", "bad-1": "rejected"}

    error(admin(gateway, "POST", "/admin/models/bad-1/promote"), 409, "version_state")
    error(admin(gateway, "POST", "/admin/models/bad-1/rollback"), 409, "version_state")
    error(admin(gateway, "POST", "/admin/models/cand-1/promote"), 409, "version_state")  # serving already
    error(admin(gateway, "POST", f"/admin/models/{v2}/promote"), 409, "version_state")  # served before
    error(admin(gateway, "POST", "/admin/models/v-unknown/rollback"), 404, "version_not_found")
    assert serving(gateway) == "cand-1"
    ok(admin(gateway, "POST", f"/admin/models/{v2}/rollback"))
    assert serving(gateway) == v2

    rollbacks = audit(gateway, "version.rollback")
    assert [(e["target"], e["status_code"]) for e in rollbacks] == [
        (v2, 200),
        ("v-unknown", 404),
        ("bad-1", 409),
        (v1, 200),
    ]
    assert rollbacks[-1]["details"]["reason"] == "v2 regressed" and rollbacks[-1]["details"]["previous_version"] == v2
    assert all(e["actor"] == ACTOR for e in rollbacks)
    promotes = audit(gateway, "version.promote")
    assert [(e["target"], e["status_code"]) for e in promotes] == [
        (v2, 409),
        ("cand-1", 409),
        ("bad-1", 409),
        ("cand-1", 200),
    ]
    assert promotes[-1]["details"]["swap_s"] > 0


def test_cancel_a_hanging_round(gateway: Gateway, history: History, tmp_path: Path) -> None:
    chat_and_rate(gateway, ["Count to two.", "Count to three."])
    before = serving(gateway)
    versions_before = versions_of(gateway)
    training = threading.Event()
    results: list[RoundResult] = []
    hanging = dataclasses.replace(default_train_config(), custom_loss_path=HANG)
    config = round_config(gateway, tmp_path, train_config=hanging, train_timeout_s=30.0, heartbeat_s=0.2)

    def on_stage(stage: str, seconds: float | None) -> None:
        if stage == "train" and seconds is None:
            training.set()

    thread = threading.Thread(target=lambda: results.append(run_round(config, on_stage=on_stage)))
    thread.start()
    assert training.wait(60)
    running = ok(admin(gateway, "GET", "/admin/runs", params={"status": "running"}))["data"]
    assert len(running) == 1
    round_id = running[0]["id"]
    cancelled = ok(admin(gateway, "POST", f"/admin/runs/{round_id}/cancel", json={"reason": "stuck"}))
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"]
    thread.join(60)
    assert not thread.is_alive() and results[0].status == "failed"
    assert "stopped" in (results[0].error or "")
    with gateway.sessions()() as session:
        assert get_round(session, round_id=round_id).status == "cancelled"  # the worker did not overwrite it
        assert list_versions(session, model=gateway.model) == versions_before
    assert serving(gateway) == before

    error(admin(gateway, "POST", f"/admin/runs/{round_id}/cancel"), 409, "round_finished")
    error(admin(gateway, "POST", "/admin/runs/round-unknown/cancel"), 404, "round_not_found")
    entries = audit(gateway, "run.cancel")
    assert [(e["target"], e["status_code"]) for e in entries[:3]] == [
        ("round-unknown", 404),
        (round_id, 409),
        (round_id, 200),
    ]
    assert entries[2]["details"] == {"previous_status": "running", "reason": "stuck"}


def test_cancel_stops_a_round_at_the_next_stage_boundary(gateway: Gateway, history: History, tmp_path: Path) -> None:
    """Cancelled while it trains, a round whose training succeeds still never records nor serves it."""
    chat_and_rate(gateway, ["Pick red.", "Pick blue."])
    before = serving(gateway)
    versions_before = versions_of(gateway)

    def on_stage(stage: str, seconds: float | None) -> None:
        if stage == "train" and seconds is None:  # the round's own thread, as training starts
            running = ok(admin(gateway, "GET", "/admin/runs", params={"status": "running"}))["data"]
            ok(admin(gateway, "POST", f"/admin/runs/{running[0]['id']}/cancel"))

    result = run_round(round_config(gateway, tmp_path), on_stage=on_stage)
    assert result.status == "failed" and "cancelled before export" in (result.error or "")
    assert "train" in result.seconds and "export" not in result.seconds
    with gateway.sessions()() as session:
        assert get_round(session, round_id=result.round_id).status == "cancelled"
        assert list_versions(session, model=gateway.model) == versions_before
    assert serving(gateway) == before


def test_audit_pages_newest_first(gateway: Gateway, history: History) -> None:
    for _ in range(4):  # audited entries of its own, whichever tests ran before
        error(admin(gateway, "POST", "/admin/runs/round-unknown/cancel"), 404, "round_not_found")
    first = ok(admin(gateway, "GET", "/admin/audit", params={"limit": 2}))
    assert len(first["data"]) == 2 and first["has_more"] is True
    second = ok(admin(gateway, "GET", "/admin/audit", params={"limit": 2, "before": first["next_before"]}))
    ids = [e["id"] for e in first["data"] + second["data"]]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 4
    assert all(set(e) == {"id", "at", "actor", "action", "target", "details", "status_code"} for e in first["data"])
    error(admin(gateway, "GET", "/admin/audit", params={"before": "x"}), 400)
