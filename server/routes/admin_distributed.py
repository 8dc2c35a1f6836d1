"""POST /admin/weights/distributed/{session}/commit and /abort: end a distributed rollout (admin key only).

``POST /admin/weights {"source": "distributed"}`` opened it and paused the replicas; the trainer
broadcast the weights to the engines it named (server.distributed_rollout).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from server.response_models import RolledOut, ServingWeights
from server.routes.deps import AdminDep, DistributedDep, json_response
from server.schemas import ERRORS

router = APIRouter()


DEFAULT_REASON = "aborted by the trainer"


class AbortRequest(BaseModel):
    reason: str = Field(DEFAULT_REASON, min_length=1, max_length=2000, description="Why, for the log.")


@router.post("/admin/weights/distributed/{session}/commit", response_model=RolledOut, responses=ERRORS)
async def commit(session: str, _: AdminDep, distributed: DistributedDep) -> Response:
    """Every replica must serve the broadcast version: then it is promoted, as a disk rollout is."""
    return json_response(await distributed.commit(session))


@router.post("/admin/weights/distributed/{session}/abort", response_model=ServingWeights, responses=ERRORS)
async def abort(session: str, _: AdminDep, distributed: DistributedDep, body: AbortRequest | None = None) -> Response:
    """The replicas reload the serving checkpoint (they may hold part of the broadcast) and resume."""
    reason = body.reason if body is not None else DEFAULT_REASON
    return json_response(await distributed.abort(session, reason))
