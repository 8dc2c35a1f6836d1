"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from server.auth import CurrentIdentity
from server.response_models import ModelList
from server.routes.deps import ChatDep, json_response
from server.schemas import ERRORS

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(_: CurrentIdentity, service: ChatDep) -> Response:
    return json_response(service.models())
