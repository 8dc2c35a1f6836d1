"""GET and POST /admin/weights: what serves now, and rolling out a model version (admin key only).

Source ``distributed`` only opens a rollout the trainer then broadcasts (server.distributed_rollout);
admin_distributed.py has its commit and abort.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.response_models import DistributedPlan, RolledOut, ServingWeights
from server.routes.deps import AdminDep, DistributedDep, WeightsDep, json_response
from server.schemas import CONFLICT, ERRORS

router = APIRouter()


class RollOutRequest(BaseModel):
    # ``_one_source`` in the schema too (for schema-based clients): delta needs delta_path; the other
    # sources need model_path and weight_version, and take no delta_path.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"source": {"const": "delta"}}, "required": ["source"]},
                    "then": {"properties": {"delta_path": {"type": "string"}}, "required": ["delta_path"]},
                    "else": {
                        "properties": {"model_path": {"type": "string"}, "weight_version": {"type": "string"}},
                        "required": ["model_path", "weight_version"],
                        "not": {"properties": {"delta_path": {"type": "string"}}, "required": ["delta_path"]},
                    },
                }
            ]
        }
    )

    source: Literal["disk", "delta", "distributed"] = Field(
        "disk",
        description="Where the new weights come from; distributed: a trainer broadcasts them to the engines "
        "(the answer names the engines and ranks; commit at /admin/weights/distributed/{session}/commit).",
    )
    model_path: str | None = Field(
        None,
        min_length=1,
        description="disk: a Hugging Face safetensors folder the engines can read. delta (optional): the whole "
        "checkpoint the delta leads to, if it exists already (checked; else built next to the delta). "
        "distributed: the checkpoint holding the broadcast weights (for rollbacks and returning replicas).",
    )
    delta_path: str | None = Field(
        None,
        min_length=1,
        description="delta: a weight delta folder (server.weight_delta) against the serving version.",
    )
    weight_version: str | None = Field(
        None, min_length=1, max_length=200, description="The version id to serve it as (delta: its target by default)."
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="distributed: how long the replicas stay paused (requests waiting) for the trainer's commit.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RollOutRequest:
        if self.source != "delta" and (self.model_path is None or self.weight_version is None):
            raise ValueError(f"source {self.source} needs model_path and weight_version")
        if self.source == "delta" and self.delta_path is None:
            raise ValueError("source delta needs delta_path")
        if self.source != "delta" and self.delta_path is not None:
            raise ValueError("delta_path goes with source delta")
        return self


@router.get("/admin/weights", response_model=ServingWeights, responses=ERRORS)
async def get_weights(_: AdminDep, service: WeightsDep) -> Response:
    return json_response(await service.serving())


@router.post("/admin/weights", response_model=RolledOut | DistributedPlan, responses={**ERRORS, **CONFLICT})
async def roll_out_weights(
    body: RollOutRequest, _: AdminDep, service: WeightsDep, distributed: DistributedDep
) -> Response:
    if body.source == "distributed":
        return json_response(await distributed.begin(body.weight_version, body.model_path, body.timeout_s))  # type: ignore[arg-type]
    if body.source == "delta":
        return json_response(await service.roll_out_delta(body.delta_path, body.weight_version, body.model_path))  # type: ignore[arg-type]
    return json_response(await service.roll_out(body.model_path, body.weight_version))  # type: ignore[arg-type]
