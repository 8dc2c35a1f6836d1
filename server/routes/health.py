"""GET /health: 200 while the engine can serve, else 503 (no auth, for load balancers)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from server.errors import error_response
from server.response_models import ErrorResponse, Health
from server.routes.deps import ChatDep, json_response

router = APIRouter()


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": ErrorResponse, "description": "The engine is not ready"}},
)
async def health(service: ChatDep) -> Response:
    if not await service.engine.health():
        return error_response(503, "The engine is not ready.")
    return json_response({"status": "ok", "weight_version": service.engine.model_info().weight_version})
