"""GET /metrics: Prometheus text exposition, admin key only (scrape with a bearer token)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.metrics import scrape
from server.prometheus import CONTENT_TYPE
from server.routes.deps import AdminDep
from server.schemas import ERRORS

router = APIRouter()


@router.get("/metrics", response_model=None, responses=ERRORS)
async def metrics(_: AdminDep, request: Request) -> Response:
    state = request.app.state
    return Response(await scrape(state.metrics, state.engine, state.sessions), media_type=CONTENT_TYPE)
