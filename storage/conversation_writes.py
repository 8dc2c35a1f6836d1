"""Writing journaled conversation records into the database: idempotent and batched.

Replaying a record that is already stored changes nothing, so the conversation log may replay its
journal after any crash. Call inside one transaction per batch; the caller commits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from storage.codec import encode_logprobs, encode_token_ids
from storage.data_deletions import drop_deleted, hold_off_deletions
from storage.dialect_insert import dialect_insert
from storage.models import (
    ApiKey,
    Completion,
    CompletionChoice,
    ConversationSession,
    EndUser,
    Feedback,
    FeedbackEvent,
    Tenant,
)
from storage.records import CompletionRecord, FeedbackRecord
from storage.times import from_unix, utcnow

logger = logging.getLogger("tandem.log")


@dataclass(frozen=True, slots=True)
class WriteResult:
    completions_inserted: int
    feedback_applied: int
    feedback_orphaned: int


def write_records(
    session: Session, completions: Sequence[CompletionRecord], feedback: Sequence[FeedbackRecord]
) -> WriteResult:
    """Store new completions, then apply feedback events in order; already stored ones are skipped.

    Completions of an end user deleted after they were made are dropped (``storage.data_deletions``).
    Feedback for a completion that is not stored (deleted, or never existed) is skipped and logged.
    """
    hold_off_deletions(session)
    new = drop_deleted(session, _new_completions(session, completions))
    tenant_ids = {rec.tenant_id for rec in new} | {rec.tenant_id for rec in feedback}
    now = utcnow()
    _insert_ignore(session, Tenant, [{"id": t, "name": t, "created_at": now} for t in tenant_ids])
    if new:
        _insert_completions(session, new)
    applied, orphaned = _apply_feedback(session, feedback)
    return WriteResult(completions_inserted=len(new), feedback_applied=applied, feedback_orphaned=orphaned)


def _insert_ignore(session: Session, model: type[Any], rows: list[dict[str, Any]]) -> None:
    if rows:
        session.execute(dialect_insert(session, model).on_conflict_do_nothing(), rows)


def _existing(session: Session, column: Any, values: Iterable[Any]) -> set[Any]:
    wanted = {value for value in values if value is not None}
    return set(session.scalars(select(column).where(column.in_(wanted)))) if wanted else set()


def _new_completions(session: Session, records: Sequence[CompletionRecord]) -> list[CompletionRecord]:
    unique = {rec.id: rec for rec in reversed(records)}
    stored = _existing(session, Completion.id, unique)
    return sorted((rec for rec in unique.values() if rec.id not in stored), key=lambda rec: rec.created_at)


def _insert_completions(session: Session, new: list[CompletionRecord]) -> None:
    end_users = _end_user_ids(session, new)
    sessions = _sessions(session, new)
    known_keys = _existing(session, ApiKey.id, (rec.api_key_id for rec in new if rec.api_key_id))
    live_previous = _existing(session, Completion.id, (s.last_completion_id for s in sessions.values()))
    for row in sessions.values():
        if row.last_completion_id not in live_previous:
            row.last_completion_id = None

    completion_rows: list[dict[str, Any]] = []
    choice_rows: list[dict[str, Any]] = []
    for rec in new:
        if rec.api_key_id and rec.api_key_id not in known_keys:
            logger.warning("completion %s names unknown api key %s; storing it without", rec.id, rec.api_key_id)
        end_user_id = end_users.get((rec.tenant_id, rec.end_user)) if rec.end_user else None
        conversation = sessions.get((rec.tenant_id, rec.session_key)) if rec.session_key else None
        turn_index = previous_id = session_id = None
        if conversation is not None:
            session_id, turn_index, previous_id = (
                conversation.id,
                conversation.turn_count,
                conversation.last_completion_id,
            )
            conversation.turn_count += 1
            conversation.last_completion_id = rec.id
            conversation.last_seen_at = max(conversation.last_seen_at, from_unix(rec.finished_at))
            if conversation.end_user_id is None:
                conversation.end_user_id = end_user_id
        completion_rows.append(
            {
                "id": rec.id,
                "tenant_id": rec.tenant_id,
                "api_key_id": rec.api_key_id if rec.api_key_id in known_keys else None,
                "end_user_id": end_user_id,
                "session_id": session_id,
                "turn_index": turn_index,
                "previous_completion_id": previous_id,
                "request_messages": rec.request_messages,
                "sampling_params": rec.sampling_params,
                "metadata": rec.metadata,
                "model": rec.model,
                "weight_version": rec.weight_version,
                "adapter_id": rec.adapter_id,
                "canary_id": rec.canary_id,
                "canary_arm": rec.canary_arm,
                "engine_replica": rec.engine_replica,
                "prompt_token_ids": encode_token_ids(rec.prompt_token_ids),
                "prompt_tokens": rec.prompt_tokens,
                "cached_tokens": rec.cached_tokens,
                "completion_tokens": rec.completion_tokens,
                "latency_ms": rec.latency_ms,
                "ttft_ms": rec.ttft_ms,
                "stream": rec.stream,
                "status": rec.status,
                "created_at": from_unix(rec.created_at),
                "finished_at": from_unix(rec.finished_at),
            }
        )
        choice_rows.extend(
            {
                "completion_id": rec.id,
                "choice_index": choice.index,
                "token_ids": encode_token_ids(choice.token_ids),
                "logprobs": encode_logprobs(choice.logprobs),
                "text": choice.text,
                "finish_reason": choice.finish_reason,
                "weight_versions": [asdict(span) for span in choice.weight_versions],
            }
            for choice in rec.choices
        )
    _insert_ignore(session, Completion, completion_rows)
    _insert_ignore(session, CompletionChoice, choice_rows)
    session.flush()


def _end_user_ids(session: Session, new: list[CompletionRecord]) -> dict[tuple[str, str], int]:
    first_seen: dict[tuple[str, str], float] = {}
    for rec in new:
        if rec.end_user:
            first_seen.setdefault((rec.tenant_id, rec.end_user), rec.created_at)
    if not first_seen:
        return {}
    _insert_ignore(
        session,
        EndUser,
        [{"tenant_id": t, "external_id": e, "created_at": from_unix(at)} for (t, e), at in first_seen.items()],
    )
    rows = session.execute(
        select(EndUser.tenant_id, EndUser.external_id, EndUser.id).where(
            tuple_(EndUser.tenant_id, EndUser.external_id).in_(list(first_seen))
        )
    )
    return {(row.tenant_id, row.external_id): row.id for row in rows}


def _sessions(session: Session, new: list[CompletionRecord]) -> dict[tuple[str, str], ConversationSession]:
    first_seen: dict[tuple[str, str], float] = {}
    for rec in new:
        if rec.session_key:
            first_seen.setdefault((rec.tenant_id, rec.session_key), rec.created_at)
    if not first_seen:
        return {}
    _insert_ignore(
        session,
        ConversationSession,
        [
            {
                "tenant_id": t,
                "session_key": k,
                "created_at": from_unix(at),
                "last_seen_at": from_unix(at),
                "turn_count": 0,
            }
            for (t, k), at in first_seen.items()
        ],
    )
    # FOR UPDATE: two gateways flushing turns of one session must not hand out the same turn index.
    rows = session.scalars(
        select(ConversationSession)
        .where(tuple_(ConversationSession.tenant_id, ConversationSession.session_key).in_(list(first_seen)))
        .with_for_update()
    )
    return {(row.tenant_id, row.session_key): row for row in rows}


def _apply_feedback(session: Session, records: Sequence[FeedbackRecord]) -> tuple[int, int]:
    seen = _existing(session, FeedbackEvent.id, (rec.id for rec in records))
    fresh: dict[str, FeedbackRecord] = {}
    for rec in records:
        if rec.id not in seen:
            fresh.setdefault(rec.id, rec)
    live = _existing(session, Completion.id, (rec.completion_id for rec in fresh.values()))
    events = [rec for rec in fresh.values() if rec.completion_id in live]
    for rec in fresh.values():
        if rec.completion_id not in live:
            logger.warning("feedback %s is for unknown completion %s; skipped", rec.id, rec.completion_id)
    if not events:
        return 0, len(fresh)

    _insert_ignore(session, FeedbackEvent, [_event_row(rec) for rec in events])
    by_choice: dict[tuple[str, int], list[FeedbackRecord]] = {}
    for rec in events:
        by_choice.setdefault((rec.completion_id, rec.choice_index), []).append(rec)
    table = Feedback.__table__
    for group in by_choice.values():
        latest = group[-1]
        values = {
            "tenant_id": latest.tenant_id,
            "score": latest.score,
            "rating": latest.rating,
            "comment": latest.comment,
            "corrected_answer": latest.corrected_answer,
            "last_event_id": latest.id,
            "updated_at": from_unix(latest.created_at),
        }
        insert = dialect_insert(session, Feedback).values(
            completion_id=latest.completion_id,
            choice_index=latest.choice_index,
            revision=len(group),
            created_at=from_unix(group[0].created_at),
            **values,
        )
        session.execute(
            insert.on_conflict_do_update(
                index_elements=[table.c.completion_id, table.c.choice_index],
                set_={**values, "revision": table.c.revision + len(group)},
            )
        )
    return len(events), len(fresh) - len(events)


def _event_row(rec: FeedbackRecord) -> dict[str, Any]:
    return {
        "id": rec.id,
        "completion_id": rec.completion_id,
        "choice_index": rec.choice_index,
        "tenant_id": rec.tenant_id,
        "score": rec.score,
        "rating": rec.rating,
        "comment": rec.comment,
        "corrected_answer": rec.corrected_answer,
        "created_at": from_unix(rec.created_at),
    }
