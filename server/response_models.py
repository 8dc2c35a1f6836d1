"""Response bodies: the ``response_model`` of every JSON route, so /openapi.json describes each answer.

The routes build their answers as plain dicts and serialise them with orjson (the hot path), and a
route that returns a Response is not re-validated by FastAPI: these models document the answers,
and tests/server/test_response_models.py checks real answers against them. A body that is a storage
view as ``dataclasses.asdict`` writes it is typed by that dataclass (``view_model``), so its fields
are declared once.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar, get_type_hints

from pydantic import BaseModel, Field, create_model

from storage.completions import CompletionView, FeedbackEventView
from storage.model_versions import ModelVersionView
from storage.records import WeightSpan

T = TypeVar("T")


def view_model(name: str, view: type[Any], doc: str, **fields: Any) -> type[BaseModel]:
    """A model named ``name`` of the dataclass ``view``'s fields, every one present (``asdict``
    writes them all), plus ``fields`` in ``create_model``'s ``(type, default)`` form."""
    hints = get_type_hints(view)
    own: dict[str, Any] = {f.name: (hints[f.name], ...) for f in dataclasses.fields(view)}
    return create_model(name, __doc__=doc, **own, **fields)


class ObjectList(BaseModel, Generic[T]):
    """The list envelope of the OpenAI API. Routes declare a named subclass (``class TenantList(
    ObjectList[Tenant])``): /openapi.json names a bare ``ObjectList[Tenant]`` ObjectList_Tenant_."""

    object: Literal["list"]
    data: list[T]


class ObjectPage(ObjectList[T], Generic[T]):
    """One page of an admin listing, newest first (admin.routes.pages)."""

    has_more: bool
    next_before: str | int | None = Field(description="Pass as ``before`` for the next page; null on the last.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantReply(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = Field(description="The calls read from the answer; null without tools")


class Choice(BaseModel):
    index: int
    message: AssistantReply
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(ObjectList[ModelCard]):
    """The served model (one)."""


class Feedback(BaseModel):
    id: str
    object: Literal["feedback"]
    completion_id: str
    choice_index: int
    score: float
    rating: Literal["up", "down"] | None
    comment: str | None
    corrected_answer: str | None
    created_at: datetime
    revision: int | None = Field(description="null while the rating is journaled, not yet in the database")
    history: list[FeedbackEventView] = Field(description="Every rating of the choice, oldest first")


CompletionLog = view_model(
    "CompletionLog",
    CompletionView,
    "A stored completion: the request, its choices with their tokens, and their feedback.",
    object=(Literal["chat.completion.log"], ...),
)


class Health(BaseModel):
    status: Literal["ok"]
    weight_version: str


class ServingWeights(BaseModel):
    model: str
    weight_version: str
    model_path: str
    version: ModelVersionView | None = Field(description="The version row, when the serving version has one")


class RolledOut(ServingWeights):
    previous_version: str
    swap_s: float = Field(description="Seconds the engines took to load the new weights")


class DistributedEngine(BaseModel):
    replica: str
    url: str
    rank_offset: int
    ranks: int


class DistributedPlan(BaseModel):
    """An open distributed rollout: the replicas are paused until its commit or abort."""

    session: str
    weight_version: str
    group_name: str
    world_size: int
    engines: list[DistributedEngine]
    timeout_s: float


class RolloutChoice(BaseModel):
    index: int
    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_versions: list[WeightSpan]
    cached_tokens: int
    routed_experts: str | None = Field(
        None, description="with return_routed_experts: base64 int32 expert ids, layers x top_k per token but the last"
    )


class RolloutUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Rollouts(BaseModel):
    model: str
    prompt_ids: list[int]
    choices: list[RolloutChoice]
    usage: RolloutUsage
    elapsed_s: float
