"""The database goes away under a live gateway (PostgreSQL behind a TCP proxy we can cut)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from sqlalchemy.engine import make_url

from tests.fixtures.tcp_proxy import TcpProxy
from tests.server.conftest import gateway_settings, run_gateway
from tests.support.polling import wait_until

HELLO = [{"role": "user", "content": "hi"}]
pytestmark = pytest.mark.postgres


def test_chat_and_feedback_survive_a_database_outage(
    postgres_url: str, postgres_proxy: TcpProxy, tiny_model: Path, tmp_path: Path
) -> None:
    proxied = make_url(postgres_url).set(port=postgres_proxy.port).render_as_string(hide_password=False)
    settings = gateway_settings(tmp_path, tiny_model, database_url=proxied)
    with run_gateway(settings, tenants=("outage-a", "outage-b")) as gateway:
        keys = gateway.keys
        client = gateway.client(keys["outage-a"])
        client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)

        postgres_proxy.stop()
        # The key is cached and the completion is journaled: serving goes on.
        reply = client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)
        feedback = client.post("/feedback", body={"completion_id": reply.id, "rating": "up"}, cast_to=object)
        assert feedback["completion_id"] == reply.id  # type: ignore[index]
        with pytest.raises(openai.InternalServerError) as caught:
            client.get(f"/completions/{reply.id}", cast_to=object)
        assert caught.value.status_code == 503 and "database" in caught.value.message
        # A key never seen before cannot be checked without the database.
        with pytest.raises(openai.InternalServerError) as caught:
            gateway.client(keys["outage-b"]).models.list()
        assert caught.value.status_code == 503

        postgres_proxy.start()

        def rated() -> bool:
            # The completion and its rating were journaled in two batches while the database was
            # away; both must land, the completion possibly a moment before its rating.
            try:
                logged = client.get(f"/completions/{reply.id}", cast_to=object)
            except openai.InternalServerError:
                return False
            feedback = logged["choices"][0]["feedback"]  # type: ignore[index]
            return feedback is not None and feedback["rating"] == "up"

        wait_until(
            rated, timeout_s=30, what="the completion and its rating read back once the database is up", interval_s=0.2
        )
