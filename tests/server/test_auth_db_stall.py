"""API keys while the database stalls (PostgreSQL behind a proxy that stops answering).

The drill found tenant-key chats hanging up to 17.8 s once the key's cache entry was due for a
recheck, and half of them answered 503 while the database refused connections.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy.engine import make_url

from storage.api_keys import hash_api_key, revoke_api_key
from storage.models import ApiKey
from tests.fixtures.tcp_proxy import TcpProxy
from tests.server.conftest import Gateway, gateway_settings, run_gateway
from tests.support.polling import wait_until

HELLO = [{"role": "user", "content": "hi"}]
TTL_S, LOOKUP_TIMEOUT_S, STALE_S = 0.3, 2.0, 8.0
pytestmark = pytest.mark.postgres


@pytest.fixture
def gateway(postgres_url: str, postgres_proxy: TcpProxy, tiny_model: Path, tmp_path: Path) -> Iterator[Gateway]:
    proxied = make_url(postgres_url).set(port=postgres_proxy.port).render_as_string(hide_password=False)
    settings = gateway_settings(
        tmp_path,
        tiny_model,
        database_url=proxied,
        auth_key_ttl_s=TTL_S,
        auth_key_stale_s=STALE_S,
        auth_lookup_timeout_s=LOOKUP_TIMEOUT_S,
    )
    with run_gateway(settings, tenants=("stall-a", "stall-b")) as gw:
        yield gw


def timed_call(client: openai.OpenAI) -> float:
    """Seconds for one authenticated call that does no model work (a chat's time would be mostly generation)."""
    started = time.monotonic()
    client.models.list()
    return time.monotonic() - started


def test_a_verified_key_serves_through_a_stall_up_to_the_stale_bound(
    gateway: Gateway, postgres_proxy: TcpProxy
) -> None:
    client = gateway.client(gateway.keys["stall-a"])
    timed_call(client)  # verified once, while the database answers
    postgres_proxy.fault = "stall"
    stalled_at = time.monotonic()
    time.sleep(2 * TTL_S)  # past the recheck time: every chat below asks the stalled database
    client.chat.completions.create(model=gateway.model, messages=HELLO, max_tokens=2)  # serves
    slowest = max(timed_call(client) for _ in range(5))
    assert slowest < LOOKUP_TIMEOUT_S, f"a verified key's call took {slowest:.2f} s with the database stalled"

    # A key never seen cannot be checked: a prompt 503 once the lookup deadline passes, not a hang.
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.client(gateway.keys["stall-b"]).models.list()
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
    assert time.monotonic() - started < LOOKUP_TIMEOUT_S + 1.0

    # Past the stale bound the verified key must be checked again, so it stops serving too.
    time.sleep(max(0.0, STALE_S - (time.monotonic() - stalled_at)) + 0.2)
    with pytest.raises(openai.InternalServerError) as caught:
        client.models.list()
    assert caught.value.status_code == 503

    postgres_proxy.fault = None
    wait_until(lambda: _serves(client), timeout_s=30, what="the key serves again once the database answers")


def test_a_revoked_key_stops_within_the_ttl_once_the_database_answers(gateway: Gateway) -> None:
    client = gateway.client(gateway.keys["stall-a"])
    timed_call(client)
    sessions = gateway.sessions()
    with sessions.begin() as session:
        key_id = session.query(ApiKey.id).filter(ApiKey.key_hash == hash_api_key(gateway.keys["stall-a"])).scalar()
        assert revoke_api_key(session, key_id) is not None
    revoked_at = time.monotonic()
    wait_until(lambda: not _serves(client), timeout_s=30, what="the revoked key is refused")
    assert time.monotonic() - revoked_at < TTL_S + 5.0  # the TTL, and a loaded machine's request time


def _serves(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
        return True
    except (openai.AuthenticationError, openai.InternalServerError):
        return False
