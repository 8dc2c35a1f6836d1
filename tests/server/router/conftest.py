from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from server.engines.local.engine import LocalEngine
from server.engines.sglang_server import create_engine_app
from tests.support.uvicorn_thread import serve_in_thread


@pytest.fixture(scope="module")
def engine_urls(tiny_model: Path) -> Iterator[list[str]]:
    """Two real `tandem engine` servers (the tiny model, in threads), shared by a module's tests."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                serve_in_thread(create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1)))
            )
            for _ in range(2)
        ]
