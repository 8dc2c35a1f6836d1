"""The ORM tables. Every change here needs an Alembic migration in ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql import text

from storage.nul_safe import NulSafeJson, NulSafeString, NulSafeText
from storage.times import UTCDateTime, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonType = NulSafeJson()  # JSONB on PostgreSQL


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JsonType,
        list[Any]: JsonType,
    }


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Names of the gateway's own tools (TANDEM_TOOLS) it runs for this tenant's requests.
    server_tools: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'"))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(32))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class RateLimit(Base):
    """Request limits of one tenant or one API key (storage/rate_limits.py); a null column: no limit."""

    __tablename__ = "rate_limits"

    scope: Mapped[str] = mapped_column(String(16), primary_key=True)  # "tenant" | "key"
    subject_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    max_concurrent_requests: Mapped[int | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class FlaggedUser(Base):
    """An end user an admin excluded from learning (storage/flagged_users.py); not needing to have chatted."""

    __tablename__ = "flagged_users"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    user_id: Mapped[str] = mapped_column(NulSafeString(256), primary_key=True)
    reason: Mapped[str | None] = mapped_column(NulSafeText())
    flagged_by: Mapped[str] = mapped_column(String(64))
    flagged_at: Mapped[datetime] = mapped_column(default=utcnow)


class EndUser(Base):
    __tablename__ = "end_users"
    __table_args__ = (UniqueConstraint("tenant_id", "external_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    external_id: Mapped[str] = mapped_column(NulSafeString(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ConversationSession(Base):
    __tablename__ = "sessions"
    __table_args__ = (UniqueConstraint("tenant_id", "session_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_key: Mapped[str] = mapped_column(NulSafeString(256))
    end_user_id: Mapped[int | None] = mapped_column(ForeignKey("end_users.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    turn_count: Mapped[int] = mapped_column(default=0)
    # No foreign key: completions already point at sessions, and this is only a cursor for linking.
    last_completion_id: Mapped[str | None] = mapped_column(String(64))


class Completion(Base):
    __tablename__ = "completions"
    __table_args__ = (
        Index("ix_completions_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_completions_session_id_created_at", "session_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    end_user_id: Mapped[int | None] = mapped_column(ForeignKey("end_users.id", ondelete="SET NULL"))
    session_id: Mapped[int | None] = mapped_column(ForeignKey("sessions.id", ondelete="SET NULL"))
    turn_index: Mapped[int | None]
    previous_completion_id: Mapped[str | None] = mapped_column(ForeignKey("completions.id", ondelete="SET NULL"))
    request_messages: Mapped[list[Any]]
    sampling_params: Mapped[dict[str, Any]]
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata")
    model: Mapped[str] = mapped_column(String(256))
    weight_version: Mapped[str] = mapped_column(String(128))
    adapter_id: Mapped[str | None] = mapped_column(String(128))  # the LoRA adapter it was served with
    # The canary whose traffic split served it, and on which side ("canary" or "control").
    canary_id: Mapped[str | None] = mapped_column(String(64), index=True)
    canary_arm: Mapped[str | None] = mapped_column(String(8))
    engine_replica: Mapped[str] = mapped_column(String(256))
    prompt_token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    prompt_tokens: Mapped[int]
    cached_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    latency_ms: Mapped[float]
    ttft_ms: Mapped[float | None]
    stream: Mapped[bool]
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime]


class CompletionChoice(Base):
    __tablename__ = "completion_choices"

    completion_id: Mapped[str] = mapped_column(ForeignKey("completions.id", ondelete="CASCADE"), primary_key=True)
    choice_index: Mapped[int] = mapped_column(primary_key=True)
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    text: Mapped[str] = mapped_column(NulSafeText())
    finish_reason: Mapped[str] = mapped_column(String(32))
    weight_versions: Mapped[list[Any]]


class Feedback(Base):
    """The current rating of one choice: the latest event wins, ``revision`` counts the events."""

    __tablename__ = "feedback"
    __table_args__ = (Index("ix_feedback_updated_at", "updated_at"),)

    completion_id: Mapped[str] = mapped_column(ForeignKey("completions.id", ondelete="CASCADE"), primary_key=True)
    choice_index: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    score: Mapped[float]
    rating: Mapped[str | None] = mapped_column(String(8))
    comment: Mapped[str | None] = mapped_column(NulSafeText())
    corrected_answer: Mapped[str | None] = mapped_column(NulSafeText())
    revision: Mapped[int]
    last_event_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class FeedbackEvent(Base):
    __tablename__ = "feedback_events"
    __table_args__ = (Index("ix_feedback_events_completion_id_choice_index", "completion_id", "choice_index"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    completion_id: Mapped[str] = mapped_column(ForeignKey("completions.id", ondelete="CASCADE"))
    choice_index: Mapped[int]
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    score: Mapped[float]
    rating: Mapped[str | None] = mapped_column(String(8))
    comment: Mapped[str | None] = mapped_column(NulSafeText())
    corrected_answer: Mapped[str | None] = mapped_column(NulSafeText())
    created_at: Mapped[datetime]


# A 64-bit sequence on PostgreSQL; SQLite only auto-assigns an "INTEGER PRIMARY KEY".
SequenceInt = BigInteger().with_variant(Integer(), "sqlite")

VERSION_STATUSES = ("candidate", "serving", "retired", "rejected")
# nothing_to_learn: the round consumed its data (the watermark moves) but could not change the policy.
ROUND_STATUSES = ("queued", "running", "succeeded", "nothing_to_learn", "failed", "cancelled")
ROUND_TRIGGERS = ("schedule", "manual")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class FeedbackChange(Base):
    """One rating change, numbered by the database (a trigger on ``feedback``): the learner's watermark.

    See ``storage.feedback_collect`` for why a database sequence and not a timestamp.
    """

    __tablename__ = "feedback_changes"
    __table_args__ = (
        ForeignKeyConstraint(
            ["completion_id", "choice_index"],
            ["feedback.completion_id", "feedback.choice_index"],
            name="fk_feedback_changes_feedback",
            ondelete="CASCADE",
        ),
        Index("ix_feedback_changes_completion_id_choice_index", "completion_id", "choice_index"),
        {"sqlite_autoincrement": True},  # never reuse a number, even after deletions
    )

    seq: Mapped[int] = mapped_column(SequenceInt, primary_key=True, autoincrement=True)
    completion_id: Mapped[str] = mapped_column(String(64))
    choice_index: Mapped[int]
    revision: Mapped[int]


class ModelVersion(Base):
    """A set of weights a model can serve; at most one ``serving`` version per model."""

    __tablename__ = "model_versions"
    __table_args__ = (
        CheckConstraint(_one_of("status", VERSION_STATUSES), name="status"),
        Index("ix_model_versions_model_created_at", "model", "created_at"),
        Index(
            "uq_model_versions_model_serving",
            "model",
            unique=True,
            postgresql_where=text("status = 'serving'"),
            sqlite_where=text("status = 'serving'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id", ondelete="SET NULL"))
    checkpoint_path: Mapped[str] = mapped_column(NulSafeText())
    sha256: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(NulSafeText())
    watermark: Mapped[int | None] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]]
    evaluation: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    promoted_at: Mapped[datetime | None]
    retired_at: Mapped[datetime | None]


class TrainingRound(Base):
    """One learner round; at most one ``running`` round per model (the per-model round lock)."""

    __tablename__ = "training_rounds"
    __table_args__ = (
        CheckConstraint(_one_of("status", ROUND_STATUSES), name="status"),
        CheckConstraint(_one_of("trigger", ROUND_TRIGGERS), name="trigger"),
        Index("ix_training_rounds_model_created_at", "model", "created_at"),
        Index(
            "uq_training_rounds_model_running",
            "model",
            unique=True,
            postgresql_where=text("status = 'running'"),
            sqlite_where=text("status = 'running'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    trigger: Mapped[str] = mapped_column(String(16))
    base_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id", ondelete="SET NULL"))
    produced_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id", ondelete="SET NULL"))
    watermark_from: Mapped[int | None] = mapped_column(BigInteger)
    watermark_to: Mapped[int | None] = mapped_column(BigInteger)
    samples_collected: Mapped[int | None]
    samples_trained: Mapped[int | None]
    config: Mapped[dict[str, Any]]
    metrics: Mapped[dict[str, Any]]
    error: Mapped[str | None] = mapped_column(NulSafeText())
    reason: Mapped[str | None] = mapped_column(NulSafeText())  # why a round had nothing to learn (0010)
    worker_id: Mapped[str | None] = mapped_column(String(256))
    # The schedule that fired it (no foreign key: the round's history outlives a deleted schedule).
    schedule_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]


class AdminAuditEntry(Base):
    """One admin action: who (the admin key's identity), what, on which target, and its HTTP status."""

    __tablename__ = "admin_audit_log"
    __table_args__ = (
        Index("ix_admin_audit_log_at", "at"),
        {"sqlite_autoincrement": True},  # ids are the listing cursor: never reuse one
    )

    id: Mapped[int] = mapped_column(SequenceInt, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(NulSafeString(256))
    details: Mapped[dict[str, Any]]
    status_code: Mapped[int]


SCHEDULE_KINDS = ("cron", "interval", "feedback")


class TrainingSchedule(Base):
    """When rounds fire: a cron expression, a fixed interval, or after ``min_feedback`` new ratings.

    Quiet hours (``quiet_start``-``quiet_end``, "HH:MM" in ``timezone``) skip the slots inside them;
    ``round_settings`` overrides the learner's round settings for the rounds it fires.
    """

    __tablename__ = "training_schedules"
    __table_args__ = (CheckConstraint(_one_of("kind", SCHEDULE_KINDS), name="kind"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    cron: Mapped[str | None] = mapped_column(String(120))
    interval_s: Mapped[int | None]
    min_feedback: Mapped[int | None]
    quiet_start: Mapped[str | None] = mapped_column(String(5))
    quiet_end: Mapped[str | None] = mapped_column(String(5))
    timezone: Mapped[str] = mapped_column(String(64))
    round_settings: Mapped[dict[str, Any]]
    enabled: Mapped[bool]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Set, with enabled false, when a round it fired drifted (learner.trainers.drift); enabling clears it.
    paused_reason: Mapped[str | None] = mapped_column(NulSafeText())
    paused_at: Mapped[datetime | None]


class ScheduleFiring(Base):
    """One claimed slot of a schedule; the primary key makes a slot fire at most once across beats."""

    __tablename__ = "schedule_firings"
    __table_args__ = (Index("ix_schedule_firings_fired_at", "fired_at"),)

    schedule_id: Mapped[str] = mapped_column(ForeignKey("training_schedules.id", ondelete="CASCADE"), primary_key=True)
    slot: Mapped[str] = mapped_column(String(64), primary_key=True)
    fired_at: Mapped[datetime] = mapped_column(default=utcnow)
    task_id: Mapped[str | None] = mapped_column(String(64))
    beat: Mapped[str | None] = mapped_column(String(256))


class DataDeletion(Base):
    """A per-user data deletion: who asked, when, and how many rows went (kept as a tombstone)."""

    __tablename__ = "data_deletions"
    __table_args__ = (
        Index("ix_data_deletions_tenant_id_end_user", "tenant_id", "end_user"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(SequenceInt, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    end_user: Mapped[str] = mapped_column(NulSafeString(256))
    deleted_at: Mapped[datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(200))
    counts: Mapped[dict[str, Any]]


ADAPTER_SCOPES = ("user", "cohort", "tenant")


class Adapter(Base):
    """A LoRA adapter version over a base model version, for one scope of one tenant (a user, a
    cohort, or the whole tenant); at most one ``serving`` adapter per scope."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint(_one_of("status", VERSION_STATUSES), name="status"),
        CheckConstraint(_one_of("scope_kind", ADAPTER_SCOPES), name="scope_kind"),
        Index("ix_adapters_tenant_id_scope_kind_scope", "tenant_id", "scope_kind", "scope"),
        Index(
            "uq_adapters_model_tenant_id_scope_kind_scope_serving",
            "model",
            "tenant_id",
            "scope_kind",
            "scope",
            unique=True,
            postgresql_where=text("status = 'serving'"),
            sqlite_where=text("status = 'serving'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    scope_kind: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(NulSafeString(256))
    # The base version it was trained over (None: the start-up weights); no foreign key, as with
    # served versions, a base may be pruned while its adapters' rows stay for the audit trail.
    base_version_id: Mapped[str | None] = mapped_column(String(128))
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("adapters.id", ondelete="SET NULL"))
    checkpoint_path: Mapped[str] = mapped_column(NulSafeText())
    sha256: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(NulSafeText())
    watermark: Mapped[int | None] = mapped_column(BigInteger)
    ratings: Mapped[int] = mapped_column(default=0)
    metrics: Mapped[dict[str, Any]]
    evaluation: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    promoted_at: Mapped[datetime | None]
    retired_at: Mapped[datetime | None]


class CohortMember(Base):
    """A user's cohort within a tenant (at most one): the scope served when the user has no adapter."""

    __tablename__ = "cohort_members"
    __table_args__ = (Index("ix_cohort_members_tenant_id_cohort", "tenant_id", "cohort"),)

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    end_user: Mapped[str] = mapped_column(NulSafeString(256), primary_key=True)
    cohort: Mapped[str] = mapped_column(NulSafeString(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


CANARY_STATUSES = ("running", "promoted", "rolled_back", "superseded")


class Canary(Base):
    """A candidate serving a share of its scope's traffic until live ratings decide it: an adapter for
    a user, cohort or tenant scope, or a model version for the base (``scope_kind`` ``base``, every
    tenant: no ``tenant_id``).

    At most one running canary per scope; the candidate's row stays ``candidate`` until the decision.
    """

    __tablename__ = "canaries"
    __table_args__ = (
        CheckConstraint(_one_of("status", CANARY_STATUSES), name="status"),
        CheckConstraint("(scope_kind = 'base') = (tenant_id IS NULL)", name="base_spans_tenants"),
        Index(
            "uq_canaries_model_tenant_id_scope_kind_scope_running",
            "model",
            "tenant_id",
            "scope_kind",
            "scope",
            unique=True,
            postgresql_where=text("status = 'running'"),
            sqlite_where=text("status = 'running'"),
        ),
        # NULL tenant ids are distinct in the index above: one running base canary per model here.
        Index(
            "uq_canaries_model_base_running",
            "model",
            unique=True,
            postgresql_where=text("status = 'running' AND scope_kind = 'base'"),
            sqlite_where=text("status = 'running' AND scope_kind = 'base'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    scope_kind: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(NulSafeString(256))
    # An adapter id, or for the base a model version id (no foreign key: it is either; a user's
    # canaries go with their data, storage.user_data).
    candidate_id: Mapped[str] = mapped_column(String(128))
    # What served the scope when the canary began (None: no adapter of its own).
    control_id: Mapped[str | None] = mapped_column(String(128))
    share: Mapped[float]
    rules: Mapped[dict[str, Any]]  # min_ratings, margin, confidence, max_duration_s
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(NulSafeText())
    numbers: Mapped[dict[str, Any]]  # the tallies and probabilities the decision read
    started_by: Mapped[str] = mapped_column(String(64))
    decided_by: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime]
    deadline: Mapped[datetime]
    decided_at: Mapped[datetime | None]
