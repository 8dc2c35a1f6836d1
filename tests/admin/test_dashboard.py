"""The dashboard (/admin/ui) in headless Chromium, on a live gateway (tiny model, SQLite) with real rows.

The seed goes through the public API where one exists (chats and ratings on three weight versions,
hot swaps through POST /admin/weights) and through the storage repositories for learning rounds,
whose real runs take minutes. The browser then signs in, reads the numbers back from the page,
creates a schedule and rolls a version back; screenshots land in test-artifacts/dashboard/.

The tests share one gateway and run in file order: the rollback changes what serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from playwright.sync_api import Browser, Locator, Page, expect

from storage.model_versions import record_model_version, set_version_status
from storage.rounds import finish_round, start_round
from storage.schedules import create_schedule, pause_schedule
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.chromium import artifact_dir, chromium

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHOTS = artifact_dir("dashboard")
WAIT_MS = 20_000  # a refresh is due every 5 s; a busy 2-core machine gets slack


@dataclass(frozen=True)
class Seed:
    v1: str  # retired: served before v2, the one to roll back to
    v2: str  # serving
    v3: str  # candidate
    succeeded_round: str
    failed_round: str
    idle_round: str


def admin(gateway: Gateway, method: str, path: str, **kwargs: Any) -> Any:
    response = httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=60, **kwargs)
    assert response.is_success, response.text
    return response.json()


def chat_and_rate(gateway: Gateway, ratings: str) -> None:
    """One answer per letter of ``ratings`` ("u" up, "d" down), rated through /v1/feedback."""
    client = gateway.client(gateway.keys["acme"])
    last = ""
    for seed, rating in enumerate(ratings):
        reply = client.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": f"Question {seed}?"}], max_tokens=4, seed=seed
        )
        client.post(
            "/feedback", body={"completion_id": reply.id, "rating": "up" if rating == "u" else "down"}, cast_to=object
        )
        last = reply.id
    client.get(f"/completions/{last}", cast_to=object)  # flushes the conversation log


def serve(gateway: Gateway, version: str, model_path: Path) -> None:
    admin(gateway, "POST", "/admin/weights", json={"model_path": str(model_path), "weight_version": version})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("dashboard"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


@pytest.fixture(scope="module")
def seed(gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Seed:
    return seed_database(gateway, tmp_path_factory.mktemp("perturbed"))


def seed_database(gateway: Gateway, scratch: Path) -> Seed:
    """Base weights rated 0 up / 2 down, v1 2 up / 1 down, v2 3 up / 1 down; v3 a candidate; two rounds."""
    tiny = tiny_model_path()
    perturbed = perturb_weights(tiny, scratch / "model")
    model, sessions = gateway.model, gateway.sessions()
    with sessions.begin() as session:
        record_model_version(session, version_id="dash-v1", model=model, checkpoint_path=str(tiny), metrics={})
        record_model_version(
            session,
            version_id="dash-v2",
            model=model,
            checkpoint_path=str(perturbed),
            parent_id="dash-v1",
            metrics={"loss": 0.4321, "reward_mean": 0.25},
        )
        record_model_version(session, version_id="dash-v3", model=model, checkpoint_path=str(tiny), parent_id="dash-v2")
    chat_and_rate(gateway, "dd")
    serve(gateway, "dash-v1", tiny)
    chat_and_rate(gateway, "udu")
    serve(gateway, "dash-v2", perturbed)
    chat_and_rate(gateway, "uuud")

    with sessions.begin() as session:
        ok = start_round(session, model=model, worker_id="dashboard-test")
        finish_round(
            session,
            round_id=ok.id,
            status="succeeded",
            watermark_to=7,
            metrics={"loss": 0.4321, "reward_mean": 0.25, "samples": 4},
            samples_collected=5,
            samples_trained=4,
            produced_version_id="dash-v2",
        )
    with sessions.begin() as session:
        bad = start_round(session, model=model, worker_id="dashboard-test")
        finish_round(session, round_id=bad.id, status="failed", error="Traceback ...\nRuntimeError: out of memory")
    with sessions.begin() as session:
        idle = start_round(session, model=model, worker_id="dashboard-test")
        finish_round(
            session, round_id=idle.id, status="nothing_to_learn", watermark_to=7, reason="every advantage is zero"
        )
    return Seed("dash-v1", "dash-v2", "dash-v3", ok.id, bad.id, idle.id)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


@pytest.fixture
def page(browser: Browser, gateway: Gateway) -> Iterator[Page]:
    """A fresh tab; it may not log a console error nor ask anything of another origin."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="UTC")
    tab = context.new_page()
    errors: list[str] = []
    foreign: list[str] = []
    tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("request", lambda request: None if request.url.startswith(gateway.url) else foreign.append(request.url))
    yield tab
    context.close()
    # Chromium logs every 4xx as a failed load: refused input (400), keys (401, 403) and actions (409)
    # are provoked on purpose; a missing endpoint (404), a 5xx or a script error is a defect.
    unexpected = [e for e in errors if not re.search(r"status of 40[0139]", e)]
    assert unexpected == [] and foreign == [], (unexpected, foreign)


def shot(page: Page, name: str) -> Path:
    path = SHOTS / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # a full-page shot of a scrolled page draws the sticky bar mid-page
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def sign_in(page: Page, gateway: Gateway, key: str = ADMIN_KEY) -> None:
    page.goto(f"{gateway.url}/admin/ui")
    page.fill("#admin-key", key)
    page.click("#login-form button[type=submit]")


def row(page: Page, tbody: str, row_id: str) -> Locator:
    """The row of ``row_id`` (a version, run, schedule or replica id) in table body ``tbody``."""
    return page.locator(f'#{tbody} tr[data-id="{row_id}"]')


def test_the_page_is_served_without_a_key_and_fetches_only_from_its_server(gateway: Gateway) -> None:
    page = httpx.get(f"{gateway.url}/admin/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert 'src="/admin/ui/app.js"' in page.text
    script = httpx.get(f"{gateway.url}/admin/ui/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{gateway.url}/admin/ui/style.css").headers["content-type"].startswith("text/css")
    assert httpx.get(f"{gateway.url}/admin/ui/index.js").json()["error"]["code"] == "not_found"
    # The data needs the key.
    assert httpx.get(f"{gateway.url}/admin/stats/ratings").status_code == 401


def test_ratings_per_version_api(gateway: Gateway, seed: Seed) -> None:
    points = admin(gateway, "GET", "/admin/stats/ratings", params={"model": gateway.model})["data"]
    summary = [(p["weight_version"], p["status"], p["rated"], p["up"], p["down"]) for p in points]
    assert summary == [("default", None, 2, 0, 2), (seed.v1, "retired", 3, 2, 1), (seed.v2, "serving", 4, 3, 1)]
    assert [round(p["mean_score"], 4) for p in points] == [-1.0, 0.3333, 0.5]
    assert points[1]["first_at"] <= points[1]["last_at"] < points[2]["first_at"]
    assert admin(gateway, "GET", "/admin/stats/ratings", params={"model": "other"})["data"] == []
    runs = admin(gateway, "GET", "/admin/runs")["data"]
    listed = {r["id"]: r for r in runs}[seed.succeeded_round]
    assert listed["metrics"]["loss"] == 0.4321 and listed["duration_s"] >= 0


def test_sign_in_refuses_a_wrong_key_and_a_tenant_key(page: Page, gateway: Gateway) -> None:
    sign_in(page, gateway, "not-the-key")
    expect(page.locator("#login-error")).to_contain_text("That is not the admin key. It is TANDEM_ADMIN_KEY")
    expect(page.locator("#dashboard")).to_be_hidden()
    shot(page, "01-wrong-key")
    page.fill("#admin-key", gateway.keys["acme"])
    page.click("#login-form button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("That is a tenant's API key")
    assert page.evaluate("sessionStorage.length") == 0


def test_dashboard_shows_the_seeded_data_and_refreshes(page: Page, gateway: Gateway, seed: Seed) -> None:
    sign_in(page, gateway)
    expect(page.locator("#serving")).to_contain_text(seed.v2)

    trend = page.locator("#trend-rows tr")
    expect(trend).to_have_count(3, timeout=WAIT_MS)
    expect(trend.nth(0)).to_contain_text("default")
    expect(trend.nth(1)).to_contain_text(re.compile(rf"{seed.v1}\s*retired\s*3\s*2\s*1\s*\+0\.33"))
    expect(trend.nth(2)).to_contain_text(re.compile(rf"{seed.v2}\s*serving\s*4\s*3\s*1\s*\+0\.50"))
    expect(trend.nth(0)).to_contain_text("\N{MINUS SIGN}1.00")
    expect(page.locator("#trend-chart svg circle")).to_have_count(3)
    expect(page.locator("#trend-chart svg")).to_contain_text("+0.50")

    expect(row(page, "model-rows", seed.v2)).to_contain_text(re.compile(rf"serving\s*{seed.v1}\s*0\.4321\s*0\.250"))
    expect(row(page, "model-rows", seed.v1).get_by_role("button")).to_have_text("Roll back")
    expect(row(page, "model-rows", seed.v3).get_by_role("button")).to_have_text("Promote")
    expect(row(page, "model-rows", seed.v2).get_by_role("button")).to_have_count(0)

    succeeded = row(page, "run-rows", seed.succeeded_round)
    expect(succeeded).to_contain_text(re.compile(r"succeeded\s*manual.*4 / 5\s*0\.4321\s*0\.250\s*" + seed.v2))
    expect(row(page, "run-rows", seed.failed_round)).to_contain_text("failedRuntimeError: out of memory")
    expect(row(page, "run-rows", seed.idle_round)).to_contain_text("nothing to learnevery advantage is zero")

    engine = page.locator("#engine-rows tr")
    expect(engine).to_have_count(1)
    expect(engine).to_contain_text(re.compile(rf"healthy\s*{seed.v2}\s*0"))
    expect(engine).to_contain_text("in rotation")
    shot(page, "02-dashboard")

    # A refused action says why: the in-process engine is the only replica.
    engine.get_by_role("button", name="Drain").click()
    expect(page.locator("#banner")).to_contain_text("Drain failed: local-0 is the in-process engine")
    expect(engine).to_contain_text("in rotation")

    # Auto-refresh: a round recorded now shows up without reloading the page.
    with gateway.sessions().begin() as session:
        fresh = start_round(session, model=gateway.model, worker_id="dashboard-test-2")
    expect(row(page, "run-rows", fresh.id)).to_contain_text("running", timeout=WAIT_MS)
    with gateway.sessions().begin() as session:
        finish_round(session, round_id=fresh.id, status="failed", error="stopped by the dashboard test")
    expect(row(page, "run-rows", fresh.id)).to_contain_text("failed", timeout=WAIT_MS)

    # The key lives in this tab's sessionStorage: a reload stays signed in, signing out forgets it.
    page.reload()
    expect(page.locator("#dashboard")).to_be_visible()
    page.click("#logout")
    expect(page.locator("#login-view")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0


def test_roll_back_a_version_from_the_page(page: Page, gateway: Gateway, seed: Seed) -> None:
    sign_in(page, gateway)
    target = row(page, "model-rows", seed.v1)
    expect(target.get_by_role("button")).to_have_text("Roll back", timeout=WAIT_MS)

    target.get_by_role("button").click()  # cancelling the dialog changes nothing
    expect(page.locator("#reason-dialog")).to_be_visible()
    page.click("#reason-dialog button[value=cancel]")
    expect(page.locator("#reason-dialog")).to_be_hidden()
    assert admin(gateway, "GET", "/admin/weights")["weight_version"] == seed.v2

    target.get_by_role("button").click()
    page.fill("#reason-input", "v2 rated worse in the dashboard test")
    shot(page, "03-rollback-dialog")
    page.click("#reason-dialog button[value=confirm]")
    expect(page.locator("#banner")).to_contain_text(f"Now serving {seed.v1} (was {seed.v2}", timeout=WAIT_MS)

    assert admin(gateway, "GET", f"/admin/models/{seed.v1}")["status"] == "serving"
    assert admin(gateway, "GET", "/admin/weights")["weight_version"] == seed.v1
    statuses = {v["id"]: v["status"] for v in admin(gateway, "GET", "/admin/models")["data"]}
    assert statuses[seed.v1] == "serving" and statuses[seed.v2] == "retired"
    audit = admin(gateway, "GET", "/admin/audit")["data"][0]
    assert audit["target"] == seed.v1 and audit["details"]["reason"] == "v2 rated worse in the dashboard test"

    expect(row(page, "model-rows", seed.v2).get_by_role("button")).to_have_text("Roll back", timeout=WAIT_MS)
    expect(page.locator("#serving")).to_contain_text(seed.v1)
    expect(page.locator("#engine-rows tr")).to_contain_text(seed.v1)
    shot(page, "04-rolled-back")


def schedules_named(gateway: Gateway, name: str) -> list[dict[str, Any]]:
    return [s for s in admin(gateway, "GET", "/admin/schedules")["data"] if s["name"] == name]


def utc_text(iso: str) -> str:
    """An API time as the page shows it (the tab runs in UTC)."""
    return datetime.fromisoformat(iso).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def test_create_disable_and_run_a_schedule_from_the_page(page: Page, gateway: Gateway) -> None:
    sign_in(page, gateway)
    form = page.locator("#schedule-form")
    create = form.get_by_role("button", name="Create schedule")
    expect(page.locator("#schedule-rows")).to_contain_text("No schedules", timeout=WAIT_MS)

    # Refused by the API: its message shows under the form and nothing is created.
    form.locator("[name=name]").fill("dash-nightly")
    form.locator("[name=cron]").fill("every night")
    create.click()
    expect(page.locator("#schedule-error")).to_contain_text("'every night' is not a cron expression")
    assert schedules_named(gateway, "dash-nightly") == []

    form.locator("[name=cron]").fill("0 3 * * *")
    form.locator("[name=quiet_start]").fill("12:00")
    form.locator("[name=quiet_end]").fill("13:30")
    form.locator("[name=timezone]").fill("Europe/Berlin")
    form.locator("[name=round_settings]").fill('{"learning_rate": 0.001}')
    create.click()
    expect(page.locator("#banner")).to_contain_text("Schedule dash-nightly created")
    expect(page.locator("#schedule-error")).to_be_hidden()
    [nightly] = schedules_named(gateway, "dash-nightly")
    assert (nightly["kind"], nightly["cron"], nightly["interval_s"], nightly["min_feedback"]) == (
        "cron",
        "0 3 * * *",
        None,
        None,
    )
    assert (nightly["quiet_start"], nightly["quiet_end"], nightly["timezone"]) == ("12:00", "13:30", "Europe/Berlin")
    assert nightly["round_settings"] == {"learning_rate": 0.001} and nightly["enabled"] is True
    assert nightly["next_fire_at"] is not None and nightly["last_fired_at"] is None
    nightly_row = row(page, "schedule-rows", nightly["id"])
    quiet = "12:00\N{EN DASH}13:30 Europe/Berlin"
    when = rf"cron 0 3 \* \* \*\s*{quiet}\s*enabled\s*{utc_text(nightly['next_fire_at'])}"
    expect(nightly_row).to_contain_text(re.compile(when), timeout=WAIT_MS)

    # The kind picks the field: a feedback schedule asks for its number of ratings.
    form.locator("[name=kind]").select_option("feedback")
    expect(form.locator("[name=cron]")).to_be_hidden()
    form.locator("[name=name]").fill("dash-after-5")
    form.locator("[name=min_feedback]").fill("5")
    create.click()
    expect(page.locator("#banner")).to_contain_text("Schedule dash-after-5 created")
    [after5] = schedules_named(gateway, "dash-after-5")
    assert (after5["kind"], after5["min_feedback"], after5["cron"], after5["next_fire_at"]) == (
        "feedback",
        5,
        None,
        None,
    )
    expect(row(page, "schedule-rows", after5["id"])).to_contain_text("after 5 new ratings", timeout=WAIT_MS)

    nightly_row.get_by_role("button", name="Disable").click()
    expect(nightly_row).to_contain_text("disabled", timeout=WAIT_MS)
    assert schedules_named(gateway, "dash-nightly")[0]["enabled"] is False
    expect(nightly_row.get_by_role("button", name="Enable")).to_be_visible()

    nightly_row.get_by_role("button", name="Run now").click()
    expect(page.locator("#banner")).to_contain_text("Schedule dash-nightly fired a round.", timeout=WAIT_MS)
    fired = schedules_named(gateway, "dash-nightly")[0]["last_fired_at"]
    assert fired is not None
    expect(nightly_row).to_contain_text(utc_text(fired), timeout=WAIT_MS)
    # A round it fires names it (a worker would start it; none runs here), and every time says its zone.
    with gateway.sessions().begin() as session:
        scheduled = start_round(
            session, model=gateway.model, worker_id="dashboard-test-3", trigger="schedule", schedule_id=nightly["id"]
        )
        finish_round(session, round_id=scheduled.id, status="failed", error="stopped by the dashboard test")
    expect(row(page, "run-rows", scheduled.id)).to_contain_text("schedule dash-nightly", timeout=WAIT_MS)
    expect(nightly_row).to_contain_text(f"{utc_text(fired)} UTC")
    shot(page, "05-schedules")


def test_the_guards_verdicts_show_on_the_page(page: Page, gateway: Gateway, seed: Seed) -> None:
    """A held-back version opens its capability checks; a schedule the drift guard paused says why."""
    checks = [
        {"name": "kl_to_root", "value": 1.86, "bound": 0.5, "passed": False, "serving": None, "rule": "must be <="},
        {"name": "echo_rate", "value": 0.0, "bound": 0.1, "passed": True, "serving": 0.0, "rule": "must be <="},
    ]
    schedule_fields = {"kind": "interval", "cron": None, "interval_s": 3600, "min_feedback": None}
    schedule_fields |= {"quiet_start": None, "quiet_end": None, "timezone": "UTC", "round_settings": {}}
    with gateway.sessions().begin() as session:
        set_version_status(
            session,
            version_id=seed.v3,
            status="candidate",
            reason="held back by the capability guard: kl_to_root 1.860 (must be <= 0.200)",
            evaluation={"checks": checks, "skipped": "the eval set is empty"},
        )
        paused = create_schedule(session, {"name": "drifting-hourly", "enabled": True, **schedule_fields})
        pause_schedule(session, paused.id, "round r7: training drifted: step 2: KL to the lineage root 1.2 > 1")
    sign_in(page, gateway)
    version = row(page, "model-rows", seed.v3)
    expect(version).to_contain_text("guard: 1 of 2 checks failed", timeout=WAIT_MS)
    # The preference margin was not checked: said, not silent.
    expect(version.locator(".warn")).to_have_text("preference not checked: the eval set is empty")
    version.locator("details.guard summary").click()
    failed = version.locator("table.checks tr.failed")
    expect(failed).to_have_count(1)
    expect(failed).to_contain_text(re.compile(r"kl_to_root\s*1\.860\s*must be <= 0\.500"))
    expect(version.locator("table.checks tr.passed")).to_contain_text("serving 0.000")
    schedule = row(page, "schedule-rows", paused.id)
    expect(schedule).to_contain_text("paused", timeout=WAIT_MS)
    expect(schedule.locator(".paused-reason")).to_contain_text("training drifted: step 2")
    expect(schedule.get_by_role("button", name="Enable")).to_be_visible()
    shot(page, "06-guards")
