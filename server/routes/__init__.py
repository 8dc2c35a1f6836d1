"""HTTP routes: thin handlers over the services."""

from __future__ import annotations

from fastapi import APIRouter

from server.routes import admin_distributed, admin_rollouts, admin_weights, chat, completions, health, metrics, models

__all__ = ["router"]

router = APIRouter()
for module in (chat, models, completions, health, admin_weights, admin_distributed, admin_rollouts, metrics):
    router.include_router(module.router)
