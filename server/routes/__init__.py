"""HTTP routes: thin handlers over the services."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.routes import admin_distributed, admin_rollouts, admin_weights, chat, completions, health, metrics, models
from server.routes.deps import refuse_nul_in_url
from server.schemas import ADMIN_ONLY

__all__ = ["router"]

# Every route refuses NUL in its path and query values (server.routes.deps.refuse_nul_in_url).
router = APIRouter(dependencies=[Depends(refuse_nul_in_url)])
for module in (chat, models, completions, health):
    router.include_router(module.router)
for module in (admin_weights, admin_distributed, admin_rollouts, metrics):
    router.include_router(module.router, responses=ADMIN_ONLY)
