from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.engines.local.engine import LocalEngine


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[LocalEngine]:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8, max_queued_requests=16)
    yield engine
    await engine.close()
