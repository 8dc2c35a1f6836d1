"""`tandem serve` starts while PostgreSQL is down: it serves the admin key from the journal and
migrates once the database is back (the drill found it could not start at all)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from admin.app import create_app
from server.app import StartupError
from tests.fixtures.tcp_proxy import TcpProxy
from tests.server.conftest import ADMIN_KEY, gateway_settings
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.postgres
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_serves_the_admin_key_while_the_database_is_down_then_stores_the_answers(
    postgres_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("server.app.MIGRATION_RETRY_S", 0.2)
    proxy = TcpProxy("127.0.0.1", 5432)
    proxy.start()
    proxy.stop()  # the port is known and refuses connections: a database that is down
    proxied = make_url(postgres_url).set(port=proxy.port).render_as_string(hide_password=False)
    settings = gateway_settings(tmp_path, tiny_model, database_url=proxied, admin_key=ADMIN_KEY)
    try:
        with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url, headers=ADMIN) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            proxy.start()
            completion = f"/v1/completions/{reply.json()['id']}"
            wait_until(lambda: http.get(completion).status_code == 200, timeout_s=60, what="the answer is stored")
    finally:
        proxy.stop()


def test_a_public_bind_without_an_admin_key_says_why_it_cannot_start(tiny_model: Path, tmp_path: Path) -> None:
    proxy = TcpProxy("127.0.0.1", 5432)
    proxy.start()
    proxy.stop()
    url = f"postgresql://postgres@127.0.0.1:{proxy.port}/test"
    settings = gateway_settings(tmp_path, tiny_model, database_url=url, host="0.0.0.0")
    started = time.monotonic()
    with pytest.raises(StartupError, match="database is unreachable"):
        create_app(settings)
    assert time.monotonic() - started < 15
