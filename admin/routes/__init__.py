"""Admin routes under ``/admin``: thin handlers over storage and the server's services; admin key only."""

from __future__ import annotations

from fastapi import APIRouter

from admin.routes import audit, engines, keys, runs, schedules, stats, tenants, ui, users, versions

__all__ = ["router"]

router = APIRouter()
for module in (runs, versions, schedules, audit, engines, keys, tenants, users, stats, ui):
    router.include_router(module.router)
