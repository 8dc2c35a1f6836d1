"""`tandem engine`: any Engine behind the subset of SGLang's native HTTP API the gateway uses.

Same paths, fields and shapes as SGLang 0.5.23, so one HTTP client drives both this process and a
real SGLang server: /generate, /model_info, /health, /health_generate, /update_weights_from_disk,
/update_weights_from_tensor, /pause_generation, /continue_generation, /flush_cache, and the
distributed sync (/init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /begin_weight_update, /end_weight_update).

Two additions SGLang does not have, announced in /model_info's ``weight_sources``:
/update_weights_from_delta (a byte-level delta against the serving version, ``server.weight_delta``)
and GET /weights_checksum (every parameter's sha256, to prove two copies of the weights are equal).

The routes live in server.engines.sglang_routes, the engine-facing work in server.engines.sglang_service;
this module wires them into the app.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI

from server.engines.local.engine import LocalEngine
from server.engines.sglang_routes import router
from server.engines.sglang_service import EngineService


def create_engine_app(open_engine: Callable[[], Awaitable[LocalEngine]]) -> FastAPI:
    """The app; ``open_engine`` runs at start-up, and the engine is closed at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = await EngineService.open(open_engine)
        app.state.engine_service = service
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="tandem engine", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.include_router(router)
    return app
