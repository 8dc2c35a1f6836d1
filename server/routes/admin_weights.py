"""GET and POST /admin/weights: what serves now, and rolling out a model version (admin key only)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from server.routes.deps import AdminDep, WeightsDep, json_response
from server.schemas import ERRORS

router = APIRouter()


class RollOutRequest(BaseModel):
    model_path: str = Field(min_length=1, description="A Hugging Face safetensors folder the engines can read.")
    weight_version: str = Field(min_length=1, max_length=200, description="The version id to serve it as.")


@router.get("/admin/weights", response_model=None, responses=ERRORS)
async def get_weights(_: AdminDep, service: WeightsDep) -> Response:
    return json_response(await service.serving())


@router.post("/admin/weights", response_model=None, responses=ERRORS)
async def roll_out_weights(body: RollOutRequest, _: AdminDep, service: WeightsDep) -> Response:
    return json_response(await service.roll_out(body.model_path, body.weight_version))
