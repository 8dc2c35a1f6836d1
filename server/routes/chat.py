"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import Response, StreamingResponse

from server.auth import CurrentIdentity
from server.rate_limits import Admitted
from server.response_models import ChatCompletion
from server.routes.deps import ChatDep, LogFields, json_response
from server.schemas import ERRORS, ChatCompletionRequest

router = APIRouter()

ADAPTER_HEADER = "X-Tandem-Adapter"
CANARY_HEADER = "X-Tandem-Canary"
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: {
            "description": "A completion, or with stream true an SSE stream of chat.completion.chunk events",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **ERRORS,
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    identity: CurrentIdentity,
    admission: Admitted,
    service: ChatDep,
    fields: LogFields,
    x_session_id: Annotated[str | None, Header(max_length=256)] = None,
) -> Response:
    call = await service.accept(body, identity, session_header=x_session_id, log_fields=fields)
    await admission.charge_tokens(call.token_budget)
    # Which adapter answered (none: the base alone) and, inside a canary's split, which side; the
    # weight version is the system_fingerprint.
    served_by = {ADAPTER_HEADER: call.adapter.id} if call.adapter else {}
    if call.route.canary_id is not None:
        served_by[CANARY_HEADER] = f"{call.route.canary_id}; arm={call.route.arm}"
    if body.stream:
        stream = await service.open_stream(call)
        return StreamingResponse(stream, media_type="text/event-stream", headers={**_STREAM_HEADERS, **served_by})
    response = json_response(await service.complete(call))
    response.headers.update(served_by)
    return response
