"""Logged completions seen by their tenant: looking one up, and rating its choices."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from server.auth import Identity
from server.conversation_log import ConversationLog
from server.database_errors import database_call
from server.errors import ApiError
from server.schemas import FeedbackRequest
from storage.completions import CompletionView, get_completion_view
from storage.records import FeedbackRecord

T = TypeVar("T")

# How long a lookup waits for journaled records to reach the database.
FLUSH_TIMEOUT_S = 5.0


def _not_found(completion_id: str) -> ApiError:
    return ApiError(404, f"No completion found with id '{completion_id}'.", param="completion_id", code="not_found")


def completion_body(view: CompletionView) -> dict[str, Any]:
    return {"object": "chat.completion.log", **dataclasses.asdict(view)}


class CompletionService:
    def __init__(self, log: ConversationLog, sessions: sessionmaker[Session]) -> None:
        self.log = log
        self._sessions = sessions

    async def _db(self, query: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._sessions() as session:
                return query(session)

        return await database_call(run)

    async def _flush(self) -> None:
        # While the database is known to be away, waiting for it would only delay the answer.
        if self.log.db_available:
            await self.log.flush(FLUSH_TIMEOUT_S)

    async def _stored(self, identity: Identity, completion_id: str) -> CompletionView | None:
        return await self._db(
            lambda s: get_completion_view(s, tenant_id=identity.tenant_id, completion_id=completion_id)
        )

    async def _pending_for(self, identity: Identity, completion_id: str) -> bool:
        """Whether the completion is still only in the journal; 404 if it is another tenant's."""
        tenant = self.log.pending_completion_tenant(completion_id)
        if tenant is None:
            return False
        if tenant != identity.tenant_id:
            raise _not_found(completion_id)
        await self._flush()
        return self.log.pending_completion_tenant(completion_id) is not None

    async def view(self, identity: Identity, completion_id: str) -> dict[str, Any]:
        if await self._pending_for(identity, completion_id):
            raise ApiError(
                503,
                f"Completion '{completion_id}' is logged but not yet in the database, which is unavailable; "
                "retry shortly.",
                code="database_unavailable",
            )
        view = await self._stored(identity, completion_id)
        if view is None:
            raise _not_found(completion_id)
        return completion_body(view)

    async def rate(self, identity: Identity, body: FeedbackRequest) -> dict[str, Any]:
        """Record a rating (a new revision if the choice was rated before)."""
        completion_id = body.completion_id
        pending = await self._pending_for(identity, completion_id)
        view = None
        try:
            view = await self._stored(identity, completion_id)
        except ApiError as error:
            if not pending or error.status != 503:  # nothing proves the completion exists, or whose it is
                raise
        if view is None and not pending:
            raise _not_found(completion_id)
        if view is not None and body.choice_index >= len(view.choices):
            raise ApiError(
                400,
                f"choice_index {body.choice_index} is out of range: the completion has {len(view.choices)} choice(s).",
                param="choice_index",
            )
        record = FeedbackRecord(
            id=f"fb-{uuid.uuid4().hex}",
            completion_id=completion_id,
            tenant_id=identity.tenant_id,
            choice_index=body.choice_index,
            score=body.resolved_score,
            rating=body.rating,
            comment=body.comment,
            corrected_answer=body.corrected_answer,
            created_at=time.time(),
        )
        await self.log.record_feedback(record)
        return await self._feedback_body(identity, record)

    async def _feedback_body(self, identity: Identity, record: FeedbackRecord) -> dict[str, Any]:
        body: dict[str, Any] = {"object": "feedback", **dataclasses.asdict(record), "revision": None, "history": []}
        del body["tenant_id"]
        # ISO 8601 like the history's events and every other time this API answers.
        body["created_at"] = datetime.fromtimestamp(record.created_at, UTC)
        # The record is safe in the journal already; the revision is known once it reaches the database.
        await self._flush()
        try:
            view = await self._stored(identity, record.completion_id)
        except ApiError:
            return body
        choice = view.choices[record.choice_index] if view and record.choice_index < len(view.choices) else None
        if choice is not None and choice.feedback is not None:
            body["revision"] = choice.feedback.revision
            body["history"] = [dataclasses.asdict(event) for event in choice.feedback.history]
        return body
