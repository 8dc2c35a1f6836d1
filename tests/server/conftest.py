"""Live gateways for the API tests: real uvicorn, the local engine on the tiny model, SQLite.

Each gateway is started once per test session and shared, so the suite stays fast on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI
from sqlalchemy.orm import Session, sessionmaker

from admin.app import create_app  # the gateway as `tandem serve` builds it, admin API included
from migrations.migrate import upgrade
from storage.api_keys import create_api_key
from storage.db import make_engine, make_session_factory
from tandem.settings import Settings
from tests.fixtures.tcp_proxy import TcpProxy
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.support.uvicorn_thread import serve_in_thread

ADMIN_KEY = "admin-test-key"
TEST_BODY_LIMIT = 256 << 10


@dataclass
class Gateway:
    url: str
    settings: Settings
    model: str
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> plaintext key

    def client(self, api_key: str | None = None, **kwargs: Any) -> OpenAI:
        key = api_key if api_key is not None else next(iter(self.keys.values()), "unused")
        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)

    def sessions(self) -> sessionmaker[Session]:
        return make_session_factory(make_engine(self.settings.resolved_database_url))


def gateway_settings(data_dir: Path, model: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "data_dir": data_dir,
        "database_url": f"sqlite:///{data_dir / 'tandem.db'}",
        "model": str(model),
        "torch_threads": 1,
        "max_batch_size": 8,
        "max_body_bytes": TEST_BODY_LIMIT,
        "log_format": "console",
        **overrides,
    }
    return Settings(**values)


def create_keys(database_url: str, tenants: tuple[str, ...]) -> dict[str, str]:
    upgrade(database_url)
    db = make_engine(database_url)
    try:
        with make_session_factory(db)() as session, session.begin():
            return {tenant: create_api_key(session, tenant_name=tenant, name="test")[0] for tenant in tenants}
    finally:
        db.dispose()


@contextmanager
def run_gateway(
    settings: Settings, *, tenants: tuple[str, ...] = (), startup_timeout_s: float = 120.0
) -> Iterator[Gateway]:
    keys = create_keys(settings.resolved_database_url, tenants) if tenants else {}
    with serve_in_thread(create_app(settings), startup_timeout_s=startup_timeout_s) as url:
        model = OpenAI(base_url=f"{url}/v1", api_key=next(iter(keys.values()), ADMIN_KEY)).models.list().data[0].id
        yield Gateway(url=url, settings=settings, model=model, keys=keys)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="session")
def perturbed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with noise on every matrix: other weights, same shapes."""
    return perturb_weights(tiny_model, tmp_path_factory.mktemp("perturbed") / "model")


@pytest.fixture(scope="session")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Keys for tenants "acme" and "globex", plus the admin key."""
    settings = gateway_settings(tmp_path_factory.mktemp("gateway"), tiny_model, admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("acme", "globex")) as gw:
        yield gw


@pytest.fixture(scope="session")
def client(gateway: Gateway) -> OpenAI:
    return gateway.client(gateway.keys["acme"])


@pytest.fixture(scope="session")
def keyless_gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Loopback, no keys at all (the quick start), and room for a single request in the engine."""
    settings = gateway_settings(tmp_path_factory.mktemp("keyless"), tiny_model, max_queued_requests=1)
    with run_gateway(settings) as gw:
        yield gw


@pytest.fixture
def postgres_proxy() -> Iterator[TcpProxy]:
    """A TCP proxy in front of the local PostgreSQL that a test can stall, cut or restart."""
    proxy = TcpProxy("127.0.0.1", 5432)
    proxy.start()
    yield proxy
    proxy.fault = None
    proxy.stop()
