"""Annotated dependencies for the services the routes call.

All are ``async def``: FastAPI runs plain ``def`` dependencies in a thread pool, a hop per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute

from server.auth import CurrentIdentity, Identity, current_identity
from server.chat_service import ChatService
from server.completions import CompletionService
from server.distributed_rollout import DistributedRollouts
from server.engine_admin import EngineAdmin
from server.errors import ApiError
from server.rollouts import RolloutService
from server.schemas import NUL_REFUSED
from server.weights import WeightService

T = TypeVar("T")

NUL_ALLOWED = "x-nul-allowed"
"""``json_schema_extra`` key of a path or query parameter that may hold NUL (stored NUL-safe, like an
end user id); ``refuse_nul_in_url`` refuses NUL in every other one."""


def app_state(kind: type[T], name: str) -> Callable[[Request], Awaitable[T]]:
    """A dependency handing out the service the app keeps as ``app.state.<name>`` (set at start-up)."""

    async def get(request: Request) -> T:
        service = getattr(request.app.state, name)
        if not isinstance(service, kind):
            raise TypeError(f"app.state.{name} is a {type(service).__name__}, not a {kind.__name__}")
        return service

    return get


ADMIN_KEY_HINT = (
    "the admin key (TANDEM_ADMIN_KEY; on a quick-start server without one, the key in the dashboard "
    "link `tandem serve` printed at start)"
)


async def require_admin(request: Request, identity: CurrentIdentity) -> Identity:
    """The caller holds the admin key: 401 without a key or with a wrong one, 403 with a tenant's key."""
    if identity.admin:
        return identity
    if identity.keyless:  # the keyless quick start asks clients for no key, but admin needs one
        _scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        if key.strip():
            raise ApiError(401, f"Incorrect admin key: this endpoint needs {ADMIN_KEY_HINT}.", code="invalid_api_key")
        raise ApiError(
            401,
            f"This endpoint needs {ADMIN_KEY_HINT}, passed as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
        )
    message = "This endpoint needs the admin key (TANDEM_ADMIN_KEY), not a tenant's API key."
    raise ApiError(403, message, code="admin_required")


async def log_fields(request: Request) -> dict[str, Any]:
    """Fields the request log line picks up (see tandem.logging.RequestLogMiddleware)."""
    fields: dict[str, Any] = {}
    request.state.log_fields = fields
    return fields


ChatDep = Annotated[ChatService, Depends(app_state(ChatService, "chat"))]
CompletionsDep = Annotated[CompletionService, Depends(app_state(CompletionService, "completions"))]
WeightsDep = Annotated[WeightService, Depends(app_state(WeightService, "weights"))]
DistributedDep = Annotated[DistributedRollouts, Depends(app_state(DistributedRollouts, "distributed"))]
RolloutsDep = Annotated[RolloutService, Depends(app_state(RolloutService, "rollouts"))]
EngineAdminDep = Annotated[EngineAdmin, Depends(app_state(EngineAdmin, "engine_admin"))]
AdminDep = Annotated[Identity, Depends(require_admin)]
LogFields = Annotated[dict[str, Any], Depends(log_fields)]


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    """``dependant`` and every dependency below it."""
    yield dependant
    for sub in dependant.dependencies:
        yield from _dependants(sub)


def _route_dependants(request: Request) -> list[Dependant]:
    route = request.scope.get("route")
    return list(_dependants(route.dependant)) if isinstance(route, APIRoute) else []


def _nul_allowed(request: Request) -> set[str]:
    return {
        param.alias
        for dependant in _route_dependants(request)
        for param in (*dependant.path_params, *dependant.query_params)
        if isinstance(extra := param.field_info.json_schema_extra, dict) and extra.get(NUL_ALLOWED)
    }


async def refuse_nul_in_url(request: Request) -> None:
    """A 400 for NUL in a path or query value (unless its parameter allows it): no id or filter holds
    one, and PostgreSQL cannot even compare text with it, so the query would fail like an outage.

    Raised as a validation error, so authentication still answers first (``authenticate_first``).
    """
    values = [("path", name, value) for name, value in request.path_params.items()]
    values += [("query", name, value) for name, value in request.query_params.multi_items()]
    refused = [item for item in values if isinstance(item[2], str) and "\0" in item[2]]
    if not refused:
        return
    allowed = _nul_allowed(request)
    errors = [
        {"type": "nul_character", "loc": (where, name), "msg": NUL_REFUSED, "input": value}
        for where, name, value in refused
        if name not in allowed
    ]
    if errors:
        raise RequestValidationError(errors)


async def authenticate_first(request: Request) -> None:
    """Authenticate as the matched route would (and check the admin key where it needs it).

    FastAPI parses and validates the request before it runs dependencies; the validation error
    handler calls this first, so a caller without a valid key learns nothing about the body or the
    parameters a route takes: 401 (or 403), not 400. Raises the ApiError the route would have.
    """
    calls = {dependant.call for dependant in _route_dependants(request)}
    if current_identity not in calls:
        return
    identity = await current_identity(request)
    if require_admin in calls:
        await require_admin(request, identity)
