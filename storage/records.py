"""What the gateway hands to the conversation log: plain records, journaled then written to the DB."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(slots=True)
class WeightSpan:
    """Output tokens [start, end) of a choice were produced by weight ``version``."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class ChoiceRecord:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_versions: list[WeightSpan] = field(default_factory=list)


@dataclass(slots=True)
class CompletionRecord:
    """One answered chat completion; ``id`` is the client's handle for feedback."""

    id: str
    tenant_id: str
    model: str
    request_messages: list[dict[str, Any]]
    sampling_params: dict[str, Any]
    prompt_token_ids: list[int]
    choices: list[ChoiceRecord]
    weight_version: str
    engine_replica: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_ms: float
    ttft_ms: float | None
    created_at: float
    finished_at: float
    stream: bool = False
    status: Literal["ok", "cancelled", "error"] = "ok"
    api_key_id: str | None = None
    end_user: str | None = None
    session_key: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    adapter_id: str | None = None  # the LoRA adapter it was served with; None: the base alone
    canary_id: str | None = None  # the canary whose split served it ...
    canary_arm: Literal["canary", "control"] | None = None  # ... and on which side


@dataclass(slots=True)
class FeedbackRecord:
    """One rating event; the latest event per (completion, choice) is the current feedback."""

    id: str
    completion_id: str
    tenant_id: str
    choice_index: int
    score: float
    rating: Literal["up", "down"] | None
    comment: str | None
    corrected_answer: str | None
    created_at: float
