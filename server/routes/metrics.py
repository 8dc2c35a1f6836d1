"""GET /metrics: Prometheus text exposition, admin key only (scrape with a bearer token)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.metrics import CONTENT_TYPE, scrape
from server.routes.deps import AdminDep
from server.schemas import ERRORS_AS_JSON

router = APIRouter()


class PrometheusText(Response):
    """The text exposition format; as the response class, it is what OpenAPI documents for a 200."""

    media_type = CONTENT_TYPE


@router.get("/metrics", response_class=PrometheusText, responses=ERRORS_AS_JSON)
async def metrics(_: AdminDep, request: Request) -> PrometheusText:
    state = request.app.state
    return PrometheusText(await scrape(state.metrics, state.engine, state.sessions))
