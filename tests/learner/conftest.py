"""A live gateway behind the learner's SGLang router, for tandem's own generate functions (tool
rollouts, workflows): slime's ``args`` as they see it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from learner.sglang_router import sglang_router
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway, tiny_model

__all__ = ["tiny_model"]  # the shared fixture, visible to this folder's tests


@pytest.fixture(scope="session")
def router_args(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    settings = gateway_settings(tmp_path_factory.mktemp("router-args"), tiny_model, admin_key=ADMIN_KEY)
    gateway: Gateway
    with run_gateway(settings) as gateway, sglang_router(gateway.url, ADMIN_KEY, timeout=120) as (ip, port):
        yield SimpleNamespace(hf_checkpoint=str(tiny_model), sglang_router_ip=ip, sglang_router_port=port)
