"""Reading completions back: frozen views with choices, decoded tokens and feedback history."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, select
from sqlalchemy.orm import Session

from storage.codec import decode_logprobs, decode_token_ids
from storage.models import Completion, CompletionChoice, ConversationSession, EndUser, Feedback, FeedbackEvent
from storage.records import WeightSpan


@dataclass(frozen=True, slots=True)
class FeedbackEventView:
    id: str
    score: float
    rating: str | None
    comment: str | None
    corrected_answer: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class FeedbackView:
    """The current rating of a choice plus every event that led to it, oldest first."""

    score: float
    rating: str | None
    comment: str | None
    corrected_answer: str | None
    revision: int
    created_at: datetime
    updated_at: datetime
    history: tuple[FeedbackEventView, ...]


@dataclass(frozen=True, slots=True)
class ChoiceView:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_versions: tuple[WeightSpan, ...]
    feedback: FeedbackView | None


@dataclass(frozen=True, slots=True)
class CompletionView:
    id: str
    tenant_id: str
    api_key_id: str | None
    end_user: str | None
    session_key: str | None
    turn_index: int | None
    previous_completion_id: str | None
    model: str
    weight_version: str
    adapter_id: str | None
    engine_replica: str
    request_messages: list[dict[str, Any]]
    sampling_params: dict[str, Any]
    metadata: dict[str, Any]
    prompt_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_ms: float
    ttft_ms: float | None
    stream: bool
    status: str
    created_at: datetime
    finished_at: datetime
    choices: tuple[ChoiceView, ...]


def completion_tenant(session: Session, completion_id: str) -> str | None:
    return session.scalar(select(Completion.tenant_id).where(Completion.id == completion_id))


def get_completion_view(session: Session, *, tenant_id: str, completion_id: str) -> CompletionView | None:
    """The completion as stored, or None if it does not exist or belongs to another tenant."""
    views = completion_views(session, Completion.id == completion_id, Completion.tenant_id == tenant_id)
    return views[0] if views else None


def completion_views(session: Session, *where: ColumnElement[bool]) -> list[CompletionView]:
    """Every completion matching ``where`` (conditions on ``Completion``'s columns), oldest first.

    Four queries whatever the number of completions: the choices and feedback are read through a
    subquery of the matching ids, never a list of bound ids (which databases cap).
    """
    matching = select(Completion.id).where(*where)
    rows = session.execute(
        select(Completion, EndUser.external_id, ConversationSession.session_key)
        .outerjoin(EndUser, EndUser.id == Completion.end_user_id)
        .outerjoin(ConversationSession, ConversationSession.id == Completion.session_id)
        .where(*where)
        .order_by(Completion.created_at, Completion.id)
    ).all()
    choices: dict[str, list[CompletionChoice]] = {}
    for choice in session.scalars(
        select(CompletionChoice)
        .where(CompletionChoice.completion_id.in_(matching))
        .order_by(CompletionChoice.completion_id, CompletionChoice.choice_index)
    ):
        choices.setdefault(choice.completion_id, []).append(choice)
    feedback = _feedback_by_choice(session, matching)
    return [
        _view(completion, end_user, session_key, choices.get(completion.id, []), feedback)
        for completion, end_user, session_key in rows
    ]


def _view(
    completion: Completion,
    end_user: str | None,
    session_key: str | None,
    choices: list[CompletionChoice],
    feedback: dict[tuple[str, int], FeedbackView],
) -> CompletionView:
    return CompletionView(
        id=completion.id,
        tenant_id=completion.tenant_id,
        api_key_id=completion.api_key_id,
        end_user=end_user,
        session_key=session_key,
        turn_index=completion.turn_index,
        previous_completion_id=completion.previous_completion_id,
        model=completion.model,
        weight_version=completion.weight_version,
        adapter_id=completion.adapter_id,
        engine_replica=completion.engine_replica,
        request_messages=completion.request_messages,
        sampling_params=completion.sampling_params,
        metadata=completion.metadata_,
        prompt_token_ids=decode_token_ids(completion.prompt_token_ids),
        prompt_tokens=completion.prompt_tokens,
        cached_tokens=completion.cached_tokens,
        completion_tokens=completion.completion_tokens,
        latency_ms=completion.latency_ms,
        ttft_ms=completion.ttft_ms,
        stream=completion.stream,
        status=completion.status,
        created_at=completion.created_at,
        finished_at=completion.finished_at,
        choices=tuple(
            ChoiceView(
                index=choice.choice_index,
                token_ids=decode_token_ids(choice.token_ids),
                logprobs=decode_logprobs(choice.logprobs),
                text=choice.text,
                finish_reason=choice.finish_reason,
                weight_versions=tuple(WeightSpan(**span) for span in choice.weight_versions),
                feedback=feedback.get((completion.id, choice.choice_index)),
            )
            for choice in choices
        ),
    )


def _feedback_by_choice(session: Session, completion_ids: Select[Any]) -> dict[tuple[str, int], FeedbackView]:
    history: dict[tuple[str, int], list[FeedbackEventView]] = {}
    events = session.scalars(
        select(FeedbackEvent)
        .where(FeedbackEvent.completion_id.in_(completion_ids))
        .order_by(FeedbackEvent.created_at, FeedbackEvent.id)
    )
    for event in events:
        history.setdefault((event.completion_id, event.choice_index), []).append(
            FeedbackEventView(
                id=event.id,
                score=event.score,
                rating=event.rating,
                comment=event.comment,
                corrected_answer=event.corrected_answer,
                created_at=event.created_at,
            )
        )
    current = session.scalars(select(Feedback).where(Feedback.completion_id.in_(completion_ids)))
    return {
        (row.completion_id, row.choice_index): FeedbackView(
            score=row.score,
            rating=row.rating,
            comment=row.comment,
            corrected_answer=row.corrected_answer,
            revision=row.revision,
            created_at=row.created_at,
            updated_at=row.updated_at,
            history=tuple(history.get((row.completion_id, row.choice_index), ())),
        )
        for row in current
    }
