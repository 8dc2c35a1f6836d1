"""POST /v1/feedback and GET /v1/completions/{id}."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from server.auth import CurrentIdentity
from server.response_models import CompletionLog, Feedback
from server.routes.deps import CompletionsDep, json_response
from server.schemas import ERRORS, FeedbackRequest

router = APIRouter()


@router.post("/v1/feedback", status_code=201, response_model=Feedback, responses=ERRORS)
async def create_feedback(body: FeedbackRequest, identity: CurrentIdentity, service: CompletionsDep) -> Response:
    return json_response(await service.rate(identity, body), status_code=201)


@router.get("/v1/completions/{completion_id}", response_model=CompletionLog, responses=ERRORS)
async def get_completion(completion_id: str, identity: CurrentIdentity, service: CompletionsDep) -> Response:
    return json_response(await service.view(identity, completion_id))
