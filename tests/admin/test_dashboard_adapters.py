"""The dashboard's per-scope learning curve (mean rating of served answers per adapter version), in
headless Chromium on a live gateway of its own: a user's two adapter versions, each rated through
the public API while it served them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from playwright.sync_api import Browser, Page, expect

from tests.admin.test_dashboard import ADMIN, WAIT_MS, shot, sign_in
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.server.engines.test_local_lora import make_adapter
from tests.support.chromium import chromium

USER = "ann"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("dash-adapters"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme",)) as gw:
        yield gw


def admin(gateway: Gateway, method: str, path: str, **kwargs: object) -> dict:  # type: ignore[type-arg]
    response = httpx.request(method, f"{gateway.url}{path}", headers=ADMIN, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert response.is_success, response.text
    return response.json()


def serve_and_rate(gateway: Gateway, folder: Path, ratings: str) -> str:
    """Register ``folder`` as ann's adapter, promote it, and have ann rate one answer per letter."""
    adapter = admin(
        gateway,
        "POST",
        "/admin/adapters",
        json={"tenant_id": "acme", "scope_kind": "user", "scope": USER, "checkpoint_path": str(folder)},
    )["id"]
    admin(gateway, "POST", f"/admin/adapters/{adapter}/promote")
    client = gateway.client(gateway.keys["acme"])
    for seed, rating in enumerate(ratings):
        raw = client.chat.completions.with_raw_response.create(
            model=gateway.model, messages=[{"role": "user", "content": f"Q{seed}?"}], max_tokens=4, user=USER
        )
        assert raw.headers["x-tandem-adapter"] == adapter
        reply = raw.parse()
        client.post(
            "/feedback", body={"completion_id": reply.id, "rating": "up" if rating == "u" else "down"}, cast_to=object
        )
    client.get(f"/completions/{reply.id}", cast_to=object)  # flushes the conversation log
    return adapter


@pytest.fixture(scope="module")
def adapters(gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("loras")
    first = serve_and_rate(gateway, make_adapter(tiny_model_path(), root / "one", seed=1, targets=["q_proj"]), "ud")
    second = serve_and_rate(gateway, make_adapter(tiny_model_path(), root / "two", seed=2, targets=["q_proj"]), "uuu")
    return first, second


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


def test_adapter_ratings_api(gateway: Gateway, adapters: tuple[str, str]) -> None:
    points = admin(gateway, "GET", "/admin/stats/adapter-ratings")["data"]
    assert [(p["adapter_id"], p["status"], p["rated"], p["up"], p["mean_score"]) for p in points] == [
        (adapters[0], "retired", 2, 1, 0.0),
        (adapters[1], "serving", 3, 3, 1.0),
    ]
    assert {(p["scope_kind"], p["scope"]) for p in points} == {("user", USER)}
    assert admin(gateway, "GET", "/admin/stats/adapter-ratings", params={"tenant": "nobody"})["data"] == []


def test_the_dashboard_draws_a_scopes_learning_curve(
    browser: Browser, gateway: Gateway, adapters: tuple[str, str]
) -> None:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="UTC")
    page: Page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sign_in(page, gateway)
        rows = page.locator("#adapter-rows tr")
        expect(rows).to_have_count(2, timeout=WAIT_MS)
        expect(rows.nth(0)).to_contain_text(adapters[0])
        expect(rows.nth(1)).to_contain_text(adapters[1])
        expect(rows.nth(1)).to_contain_text("+1.00")
        expect(page.locator("#adapter-chart svg circle")).to_have_count(2)
        expect(page.locator("#adapter-scope")).to_have_value(f"acme / user / {USER}")
        shot(page, "adapters")
    finally:
        context.close()
    assert errors == []


def test_the_dashboard_shows_a_running_canary_and_rolls_it_back(
    browser: Browser, gateway: Gateway, adapters: tuple[str, str], tmp_path: Path
) -> None:
    folder = make_adapter(tiny_model_path(), tmp_path / "three", seed=3, targets=["q_proj"])
    body = {"tenant_id": "acme", "scope_kind": "user", "scope": USER, "checkpoint_path": str(folder)}
    candidate = admin(gateway, "POST", "/admin/adapters", json=body)["id"]
    canary = admin(gateway, "POST", f"/admin/adapters/{candidate}/canary", json={"share": 0.25})["canary"]["id"]
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="UTC")
    page: Page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sign_in(page, gateway)
        row = page.locator(f"#canary-rows tr[data-id='{canary}']")
        expect(row).to_contain_text("running", timeout=WAIT_MS)
        expect(row).to_contain_text(candidate)
        expect(row).to_contain_text(adapters[1])  # the control: what serves ann now
        expect(row).to_contain_text("25 %")
        shot(page, "canary-running")
        row.get_by_role("button", name="Roll back").click()
        page.fill("#reason-input", "not this one")
        page.click("#reason-dialog button[value=confirm]")
        expect(page.locator("#banner")).to_contain_text(f"Canary {canary} rolled back.", timeout=WAIT_MS)
        expect(row).to_contain_text("rolled_back", timeout=WAIT_MS)
        expect(row).to_contain_text("not this one")
        expect(row.get_by_role("button")).to_have_count(0)
    finally:
        context.close()
    assert errors == []
    assert admin(gateway, "GET", f"/admin/adapters/{candidate}")["status"] == "rejected"
