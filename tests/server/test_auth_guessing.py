"""Guessing API keys costs the database little: failed authentications are limited per client
address, and unknown keys are cached apart from known ones (the drill: 300 random keys cost 300
database lookups, and unknown keys were cached until a wholesale clear at 10,000 entries)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from server.auth import MAX_UNKNOWN_KEYS, Authenticator, _Verified
from storage.db import make_engine, make_session_factory
from tests.server.conftest import Gateway, create_keys, gateway_settings, run_gateway

FAILURES_PER_MINUTE = 5


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(
        tmp_path_factory.mktemp("guessing"), tiny_model, auth_failures_per_minute=FAILURES_PER_MINUTE
    )
    with run_gateway(settings, tenants=("guessed",)) as gw:
        yield gw


def models(gateway: Gateway, key: str) -> httpx.Response:
    return httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_an_address_that_keeps_failing_is_refused_before_the_database(gateway: Gateway) -> None:
    known = gateway.keys["guessed"]
    assert models(gateway, known).status_code == 200
    guesses = [models(gateway, "tdm-" + secrets.token_urlsafe(32)) for _ in range(FAILURES_PER_MINUTE + 3)]
    assert [r.status_code for r in guesses] == [401] * FAILURES_PER_MINUTE + [429] * 3
    assert guesses[-1].json()["error"]["code"] == "too_many_failed_authentications"
    assert int(guesses[-1].headers["retry-after"]) > 0
    assert models(gateway, known).status_code == 200  # a key verified before is not locked out


async def test_unknown_keys_cannot_evict_known_ones(sqlite_url: str) -> None:
    keys = create_keys(sqlite_url, ("kept",))
    sessions = make_session_factory(make_engine(sqlite_url))
    windows = MovingWindowRateLimiter(MemoryStorage())
    auth = Authenticator(sessions, admin_key=None, loopback=False, failure_limiter=windows)
    try:
        known = await auth.identify(f"Bearer {keys['kept']}")
        for _ in range(MAX_UNKNOWN_KEYS + 10):  # what a flood of wrong keys leaves behind
            auth._store(secrets.token_bytes(32), _Verified(None, 0.0))
        assert len(auth._unknown) == MAX_UNKNOWN_KEYS
        sessions.kw["bind"].dispose()
        sessions.configure(bind=make_engine("sqlite:////nonexistent/dir/db.sqlite"))  # no database now
        assert await auth.identify(f"Bearer {keys['kept']}") == known
    finally:
        auth.close()
