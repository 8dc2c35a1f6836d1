"""The quick start as a newcomer meets it: a real `tandem serve` on loopback (tiny model, SQLite).

Without TANDEM_ADMIN_KEY it prints a dashboard link carrying this run's admin login, the README's
keyless client works, and the admin API answers 401 (never 403) to a caller without the admin key,
saying where the key is. With TANDEM_ADMIN_KEY set, the keyless client still works on loopback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import expect

from tests.e2e.processes import Process, start_tandem
from tests.fixtures.tiny_model import tiny_model_path
from tests.support.chromium import chromium
from tests.support.polling import wait_until

LINK = re.compile(r"Dashboard: (http://127\.0\.0\.1:\d+/admin/ui)(#key=[A-Za-z0-9_-]+)?")


def dashboard_line(process: Process) -> re.Match[str]:
    wait_until(lambda: LINK.search(process.log.read_text()), timeout_s=30, what="the dashboard link is printed")
    found = LINK.search(process.log.read_text())
    assert found is not None
    return found


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    process = start_tandem(
        ["serve", "--model", str(tiny_model_path())],
        data_dir=tmp_path_factory.mktemp("quick-start"),
        ready_path="/health",
    )
    try:
        yield process
    finally:
        process.stop()


def chat(url: str) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # the README's client
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    return reply.choices[0].message.content or ""


def test_the_link_signs_the_dashboard_in_and_leaves_the_address_bar(keyless: Process) -> None:
    found = dashboard_line(keyless)
    assert found.group(1) == f"{keyless.url}/admin/ui" and found.group(2), found.group(0)
    key = found.group(2).removeprefix("#key=")
    assert key not in re.sub(LINK, "", keyless.log.read_text())  # printed in the link only, never logged
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(found.group(0).removeprefix("Dashboard: "))
        expect(page.locator("#dashboard")).to_be_visible(timeout=30_000)
        expect(page.locator("#serving")).to_contain_text("default", timeout=30_000)
        assert "#key" not in page.url and key not in page.url
        assert errors == []


def test_the_first_log_line_names_the_data_directory(keyless: Process) -> None:
    first = keyless.log.read_text().splitlines()[0]
    assert "tandem serve starting" in first and str(keyless.log.parent) in first, first


def test_admin_without_the_key_is_401_and_says_where_the_key_is(keyless: Process) -> None:
    key = (dashboard_line(keyless).group(2) or "").removeprefix("#key=")
    for path in ("/admin/engines", "/metrics"):
        missing = httpx.get(f"{keyless.url}{path}", timeout=30)
        assert missing.status_code == 401, missing.text
        body = missing.json()["error"]
        assert body["code"] == "missing_api_key" and "dashboard link `tandem serve` printed" in body["message"]
        wrong = httpx.get(f"{keyless.url}{path}", headers={"Authorization": "Bearer guess"}, timeout=30)
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
        signed = httpx.get(f"{keyless.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert signed.status_code == 200, signed.text
    assert chat(keyless.url)  # the keyless client is unaffected


def test_an_admin_key_leaves_the_loopback_client_keyless(tmp_path: Path) -> None:
    process = start_tandem(
        ["serve", "--model", str(tiny_model_path())],
        data_dir=tmp_path,
        ready_path="/health",
        env={"TANDEM_ADMIN_KEY": "chosen-by-me"},
    )
    try:
        found = dashboard_line(process)
        assert found.group(2) is None  # the admin key is the operator's own: the link carries nothing
        assert "sign in with TANDEM_ADMIN_KEY" in process.log.read_text()
        assert chat(process.url)
        headers = {"Authorization": "Bearer chosen-by-me"}
        assert httpx.get(f"{process.url}/admin/engines", headers=headers, timeout=30).status_code == 200
        assert httpx.get(f"{process.url}/admin/engines", timeout=30).status_code == 401
    finally:
        process.stop()
