from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from server.engines.local.engine import LocalEngine
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    torch.set_num_threads(1)
    return tiny_model_path()


@pytest.fixture(scope="session")
def perturbed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturb_weights(tiny_model, tmp_path_factory.mktemp("perturbed") / "model")


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[LocalEngine]:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8, max_queued_requests=16)
    yield engine
    await engine.close()
