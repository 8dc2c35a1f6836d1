"""Admin routes under ``/admin``: thin handlers over storage and the server's services; admin key only."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from admin.routes import (
    adapters,
    audit,
    canaries,
    engines,
    flagged_users,
    keys,
    limits,
    runs,
    schedules,
    stats,
    tenants,
    tools,
    ui,
    users,
    versions,
)
from server.routes.deps import refuse_nul_in_url
from server.schemas import ADMIN_ONLY

__all__ = ["router"]

# Every route refuses NUL in its path and query values (server.routes.deps.refuse_nul_in_url).
router = APIRouter(dependencies=[Depends(refuse_nul_in_url)])
for module in (
    runs,
    versions,
    adapters,
    canaries,
    schedules,
    audit,
    engines,
    keys,
    tenants,
    limits,
    tools,
    users,
    flagged_users,
    stats,
    ui,
):
    router.include_router(module.router, responses=ADMIN_ONLY)
