"""Annotated dependencies for the services the routes call.

All are ``async def``: FastAPI runs plain ``def`` dependencies in a thread pool, a hop per request.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from fastapi.responses import Response

from server.auth import CurrentIdentity, Identity
from server.chat_service import ChatService
from server.completions import CompletionService
from server.distributed_rollout import DistributedRollouts
from server.errors import ApiError
from server.rollouts import RolloutService
from server.weights import WeightService


async def _chat(request: Request) -> ChatService:
    return request.app.state.chat


async def _completions(request: Request) -> CompletionService:
    return request.app.state.completions


async def _weights(request: Request) -> WeightService:
    return request.app.state.weights


async def _distributed(request: Request) -> DistributedRollouts:
    return request.app.state.distributed


async def _rollouts(request: Request) -> RolloutService:
    return request.app.state.rollouts


async def _admin(identity: CurrentIdentity) -> Identity:
    if not identity.admin:
        raise ApiError(403, "This endpoint needs the admin key (TANDEM_ADMIN_KEY).", code="admin_required")
    return identity


async def log_fields(request: Request) -> dict[str, Any]:
    """Fields the request log line picks up (see tandem.logging.RequestLogMiddleware)."""
    fields: dict[str, Any] = {}
    request.state.log_fields = fields
    return fields


ChatDep = Annotated[ChatService, Depends(_chat)]
CompletionsDep = Annotated[CompletionService, Depends(_completions)]
WeightsDep = Annotated[WeightService, Depends(_weights)]
DistributedDep = Annotated[DistributedRollouts, Depends(_distributed)]
RolloutsDep = Annotated[RolloutService, Depends(_rollouts)]
AdminDep = Annotated[Identity, Depends(_admin)]
LogFields = Annotated[dict[str, Any], Depends(log_fields)]


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")
