"""/admin/schedules on a live gateway (tiny model, SQLite, the learner queue on the machine's Redis):
CRUD, validation naming the field, the admin key, the audit log, and run-now's task in the queue."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
import torch

from learner.celery_app import LEARN
from storage.audit import list_admin_actions
from storage.db import make_engine, make_session_factory
from storage.schedules import pause_schedule
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.learner_queue import REDIS, redis_prefix, sent_tasks

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACTOR = "admin:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12]
FIELDS = {"name", "kind", "cron", "interval_s", "min_feedback", "quiet_start", "quiet_end", "timezone"}
FIELDS |= {"round_settings", "enabled", "id", "created_at", "updated_at", "next_fire_at", "last_fired_at"}
FIELDS |= {"paused_reason", "paused_at"}


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    with redis_prefix() as prefix:
        yield prefix


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    data_dir = tmp_path_factory.mktemp("schedules")
    settings = gateway_settings(
        data_dir, tiny_model_path(), admin_key=ADMIN_KEY, redis_url=REDIS, redis_key_prefix=prefix
    )
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def admin(gateway: Gateway, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=30, **kwargs)


def create(gateway: Gateway, **body: Any) -> dict[str, Any]:
    response = admin(gateway, "POST", "/admin/schedules", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def audit(gateway: Gateway, target: str) -> list[tuple[str, int]]:
    with gateway.sessions()() as session:
        actions = list_admin_actions(session, limit=1000)
    return [(a.action, a.status_code) for a in reversed(actions) if a.target == target and a.actor == ACTOR]


def parse(value: str) -> datetime:
    return datetime.fromisoformat(value)


PATHS = [
    ("GET", "/admin/schedules"),
    ("POST", "/admin/schedules"),
    ("GET", "/admin/schedules/sched_x"),
    ("PATCH", "/admin/schedules/sched_x"),
    ("DELETE", "/admin/schedules/sched_x"),
    ("POST", "/admin/schedules/sched_x/enable"),
    ("POST", "/admin/schedules/sched_x/disable"),
    ("POST", "/admin/schedules/sched_x/run"),
]


@pytest.mark.parametrize(("method", "path"), PATHS)
def test_needs_the_admin_key(gateway: Gateway, method: str, path: str) -> None:
    body = {"name": "x", "kind": "interval", "interval_s": 60}
    missing = httpx.request(method, f"{gateway.url}{path}", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    tenant = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    forbidden = httpx.request(method, f"{gateway.url}{path}", json=body, headers=tenant)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "admin_required"


def test_create_show_edit_toggle_and_delete(gateway: Gateway) -> None:
    before = datetime.now(UTC)
    created = create(
        gateway,
        name="nightly",
        kind="cron",
        cron="0 3 * * *",
        timezone="Europe/Berlin",
        quiet_start="23:00",
        quiet_end="01:00",
        round_settings={"learning_rate": "2e-6", "steps": 2},
    )
    assert set(created) == FIELDS
    assert created["round_settings"] == {"learning_rate": 2e-6, "steps": 2}  # as a worker will read it
    assert (created["enabled"], created["last_fired_at"], created["interval_s"]) == (True, None, None)
    fires = parse(created["next_fire_at"])
    assert before < fires <= before + timedelta(days=1) and fires.astimezone(ZoneInfo("Europe/Berlin")).hour == 3
    schedule_id = created["id"]
    assert admin(gateway, "GET", f"/admin/schedules/{schedule_id}").json() == created

    # Another kind: the fields of the old one are cleared, the new one's checked.
    edited = admin(gateway, "PATCH", f"/admin/schedules/{schedule_id}", json={"kind": "interval", "interval_s": 3600})
    assert edited.status_code == 200, edited.text
    shown = edited.json()
    assert (shown["kind"], shown["cron"], shown["interval_s"], shown["quiet_start"]) == (
        "interval",
        None,
        3600,
        "23:00",
    )
    assert parse(shown["updated_at"]) > parse(created["updated_at"]) and shown["created_at"] == created["created_at"]
    assert parse(shown["next_fire_at"]).timestamp() % 3600 == 0
    cleared = admin(gateway, "PATCH", f"/admin/schedules/{schedule_id}", json={"quiet_start": None, "quiet_end": None})
    assert (cleared.json()["quiet_start"], cleared.json()["quiet_end"]) == (None, None)

    disabled = admin(gateway, "POST", f"/admin/schedules/{schedule_id}/disable").json()
    assert disabled["enabled"] is False and disabled["next_fire_at"] is None
    enabled = admin(gateway, "POST", f"/admin/schedules/{schedule_id}/enable").json()
    assert enabled["enabled"] is True and enabled["next_fire_at"] is not None

    deleted = admin(gateway, "DELETE", f"/admin/schedules/{schedule_id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True and deleted.json()["name"] == "nightly"
    assert admin(gateway, "GET", f"/admin/schedules/{schedule_id}").status_code == 404
    assert audit(gateway, schedule_id) == [
        ("schedule.create", 201),
        ("schedule.update", 200),
        ("schedule.update", 200),
        ("schedule.disable", 200),
        ("schedule.enable", 200),
        ("schedule.delete", 200),
    ]


def test_list_pages_newest_first(gateway: Gateway) -> None:
    ids = [create(gateway, name=f"page-{i}", kind="feedback", min_feedback=5 + i)["id"] for i in range(3)]
    first = admin(gateway, "GET", "/admin/schedules", params={"limit": 2}).json()
    assert first["object"] == "list" and first["has_more"] is True and len(first["data"]) == 2
    rest = admin(gateway, "GET", "/admin/schedules", params={"limit": 500, "before": first["next_before"]}).json()
    listed = [s["id"] for s in first["data"] + rest["data"]]
    assert [i for i in listed if i in ids] == ids[::-1] and len(listed) == len(set(listed))
    assert rest["has_more"] is False and rest["next_before"] is None
    assert all(s["next_fire_at"] is None for s in first["data"] if s["kind"] == "feedback")
    bad = admin(gateway, "GET", "/admin/schedules", params={"before": "sched_nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "before"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"kind": "interval", "interval_s": 60}, "name"),
        ({"name": "x", "kind": "weekly"}, "kind"),
        ({"name": "x", "kind": "cron"}, "cron"),
        ({"name": "x", "kind": "cron", "cron": "every day"}, "cron"),
        ({"name": "x", "kind": "cron", "cron": "0 3 * * *", "interval_s": 60}, "interval_s"),
        ({"name": "x", "kind": "interval"}, "interval_s"),
        ({"name": "x", "kind": "interval", "interval_s": 0}, "interval_s"),
        ({"name": "x", "kind": "interval", "interval_s": 2**31}, "interval_s"),
        ({"name": "x", "kind": "interval", "interval_s": "soon"}, "interval_s"),
        ({"name": "x", "kind": "feedback"}, "min_feedback"),
        ({"name": "x", "kind": "feedback", "min_feedback": -1}, "min_feedback"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "quiet_start": "22:00"}, "quiet_end"),
        (
            {"name": "x", "kind": "interval", "interval_s": 60, "quiet_start": "7pm", "quiet_end": "06:00"},
            "quiet_start",
        ),
        ({"name": "x", "kind": "interval", "interval_s": 60, "timezone": "Europe/Atlantis"}, "timezone"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "round_settings": {"lr": 1}}, "round_settings.lr"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "round_settings": {"steps": 0}}, "round_settings.steps"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "round_settings": {"reward": "custom"}}, "round_settings"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "round_settings": []}, "round_settings"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "every": "day"}, "every"),
        ({"name": "x", "kind": "interval", "interval_s": 60, "enabled": None}, "enabled"),
    ],
)
def test_invalid_schedules_are_400_naming_the_field(gateway: Gateway, body: dict[str, Any], param: str) -> None:
    response = admin(gateway, "POST", "/admin/schedules", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_edits_are_checked_and_names_are_unique(gateway: Gateway) -> None:
    kept = create(gateway, name="unique", kind="interval", interval_s=600)
    other = create(gateway, name="other", kind="interval", interval_s=600)
    taken = admin(gateway, "POST", "/admin/schedules", json={"name": "unique", "kind": "feedback", "min_feedback": 1})
    assert taken.status_code == 409 and taken.json()["error"] == {
        "message": "Another schedule is named 'unique'.",
        "type": "invalid_request_error",
        "param": "name",
        "code": "schedule_exists",
    }
    renamed = admin(gateway, "PATCH", f"/admin/schedules/{other['id']}", json={"name": "unique"})
    assert renamed.status_code == 409
    for change, param in [
        ({"kind": "cron"}, "cron"),  # the interval is cleared, and a cron schedule needs its expression
        ({"interval_s": None}, "interval_s"),
        ({"name": None}, "name"),
        ({"quiet_end": "06:00"}, "quiet_start"),
        ({"round_settings": {"kl_type": "k9"}}, "round_settings.kl_type"),
    ]:
        refused = admin(gateway, "PATCH", f"/admin/schedules/{kept['id']}", json=change)
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, param), refused.text
    assert admin(gateway, "GET", f"/admin/schedules/{kept['id']}").json() == kept  # nothing changed
    assert audit(gateway, other["id"]) == [("schedule.create", 201), ("schedule.update", 409)]
    assert audit(gateway, kept["id"])[-5:] == [("schedule.update", 400)] * 5


@pytest.mark.parametrize(("method", "suffix"), [("GET", ""), ("PATCH", ""), ("DELETE", ""), ("POST", "/run")])
def test_an_unknown_schedule_is_404(gateway: Gateway, method: str, suffix: str) -> None:
    response = admin(gateway, method, f"/admin/schedules/sched_missing{suffix}", json={})
    assert response.status_code == 404 and response.json()["error"]["code"] == "schedule_not_found"


def test_run_now_sends_the_schedules_round_settings(gateway: Gateway, prefix: str) -> None:
    schedule = create(
        gateway, name="run-me", kind="feedback", min_feedback=50, enabled=False, round_settings={"kl_coef": 0.2}
    )
    already = {t.task_id for t in sent_tasks(prefix)}
    response = admin(gateway, "POST", f"/admin/schedules/{schedule['id']}/run")
    assert response.status_code == 202, response.text
    answer = response.json()
    assert set(answer) == {"task_id", "schedule_id"} and answer["schedule_id"] == schedule["id"]

    (sent,) = [t for t in sent_tasks(prefix) if t.task_id not in already]
    assert (sent.task_id, sent.task, sent.expires) == (answer["task_id"], LEARN, None)
    assert sent.kwargs == {"schedule_id": schedule["id"], "round_settings": {"kl_coef": 0.2}, "trigger": "manual"}
    shown = admin(gateway, "GET", f"/admin/schedules/{schedule['id']}").json()
    assert shown["last_fired_at"] is not None and shown["enabled"] is False
    assert audit(gateway, schedule["id"]) == [("schedule.create", 201), ("schedule.run", 202)]


def test_a_schedule_the_drift_guard_paused_shows_why_and_enable_resumes_it(gateway: Gateway) -> None:
    schedule_id = create(gateway, name="drifts", kind="interval", interval_s=600)["id"]
    engine = make_engine(gateway.settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:  # what a drifted round does (learner.round)
        pause_schedule(session, schedule_id, "round r9: training drifted: step 1: KL to the lineage root 2.0 > 1")
    engine.dispose()
    shown = admin(gateway, "GET", f"/admin/schedules/{schedule_id}").json()
    assert shown["enabled"] is False and shown["next_fire_at"] is None
    assert shown["paused_reason"].startswith("round r9: training drifted")
    assert parse(shown["paused_at"]) <= datetime.now(UTC)
    resumed = admin(gateway, "POST", f"/admin/schedules/{schedule_id}/enable").json()
    assert resumed["enabled"] is True and resumed["paused_reason"] is None and resumed["paused_at"] is None
