"""/admin/stats/ratings: how users rated each model version, oldest version first (the dashboard's trend);
/admin/stats/adapter-ratings: the same per adapter version of each scope (the per-scope learning curve)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from admin.deps import SessionsDep, in_thread
from admin.schemas import RatedAdapterList, RatedVersionList
from server.routes.deps import AdminDep, json_response
from server.schemas import ERRORS
from storage.rating_trend import AdapterRating, VersionRating, adapter_rating_trend, rating_trend

router = APIRouter()


@router.get("/admin/stats/ratings", response_model=RatedVersionList, responses=ERRORS)
async def ratings(
    _: AdminDep, sessions: SessionsDep, model: Annotated[str | None, Query(max_length=256)] = None
) -> Response:
    """Per weight version: rated answers, ups and downs, the mean score in [-1, 1], first and last answer."""

    def read() -> list[VersionRating]:
        with sessions() as session:
            return rating_trend(session, model=model)

    points = await in_thread(read)
    data: list[dict[str, Any]] = [{**asdict(point), "object": "version_rating"} for point in points]
    return json_response({"object": "list", "data": data})


@router.get("/admin/stats/adapter-ratings", response_model=RatedAdapterList, responses=ERRORS)
async def adapter_ratings(
    _: AdminDep,
    sessions: SessionsDep,
    model: Annotated[str | None, Query(max_length=256)] = None,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """Per adapter version, by scope: the mean rating of the answers it served, in the order they served."""

    def read() -> list[AdapterRating]:
        with sessions() as session:
            return adapter_rating_trend(session, model=model, tenant_id=tenant)

    points = await in_thread(read)
    data: list[dict[str, Any]] = [{**asdict(point), "object": "adapter_rating"} for point in points]
    return json_response({"object": "list", "data": data})
