"""The conversation log as plain records, one per answer (choice): what `tandem export` writes as JSONL.

Token ids and logprobs come decoded (``storage.codec``), the request's messages and sampling as
they were sent, and the answer's current rating if it has one. Rows stream in creation order,
a page at a time, so a large log never sits in memory.

Runs inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.codec import decode_logprobs, decode_token_ids
from storage.models import Completion, CompletionChoice, EndUser, Feedback

__all__ = ["export_records"]

PAGE_ROWS = 500


def export_records(
    session: Session, *, model: str | None = None, tenant_id: str | None = None, since: datetime | None = None
) -> Iterator[dict[str, Any]]:
    """Every logged answer (filtered by ``model``, ``tenant_id``, created at or after ``since``), oldest first."""
    query = (
        select(Completion, CompletionChoice, EndUser.external_id, Feedback)
        .join(CompletionChoice, CompletionChoice.completion_id == Completion.id)
        .outerjoin(EndUser, EndUser.id == Completion.end_user_id)
        .outerjoin(
            Feedback,
            (Feedback.completion_id == CompletionChoice.completion_id)
            & (Feedback.choice_index == CompletionChoice.choice_index),
        )
        .order_by(Completion.created_at, Completion.id, CompletionChoice.choice_index)
        .execution_options(yield_per=PAGE_ROWS)
    )
    if model is not None:
        query = query.where(Completion.model == model)
    if tenant_id is not None:
        query = query.where(Completion.tenant_id == tenant_id)
    if since is not None:
        query = query.where(Completion.created_at >= since)
    for completion, choice, user, feedback in session.execute(query):
        yield {
            "completion_id": completion.id,
            "choice": choice.choice_index,
            "created_at": completion.created_at.isoformat(),
            "tenant_id": completion.tenant_id,
            "user": user,
            "model": completion.model,
            "weight_version": completion.weight_version,
            "weight_versions": choice.weight_versions,
            "adapter_id": completion.adapter_id,
            "messages": completion.request_messages,
            "sampling": completion.sampling_params,
            "prompt_token_ids": decode_token_ids(completion.prompt_token_ids),
            "text": choice.text,
            "finish_reason": choice.finish_reason,
            "token_ids": decode_token_ids(choice.token_ids),
            "logprobs": decode_logprobs(choice.logprobs),
            "feedback": None
            if feedback is None
            else {
                "rating": feedback.rating,
                "score": feedback.score,
                "comment": feedback.comment,
                "corrected_answer": feedback.corrected_answer,
            },
        }
