"""POST /admin/rollouts: fresh samples of a prompt from the serving weights, for the learner (admin key only)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from server.response_models import Rollouts
from server.rollouts import RolloutRequest
from server.routes.deps import AdminDep, RolloutsDep, json_response
from server.schemas import ERRORS

router = APIRouter()


@router.post("/admin/rollouts", response_model=Rollouts, responses=ERRORS)
async def roll_out_samples(body: RolloutRequest, _: AdminDep, service: RolloutsDep) -> Response:
    return json_response(await service.generate(body))
