"""Initial schema: tenants, keys, end users, sessions, completions, feedback.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "end_users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("external_id", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_end_users_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_end_users")),
        sa.UniqueConstraint("tenant_id", "external_id", name=op.f("uq_end_users_tenant_id_external_id")),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_key", sa.String(length=256), nullable=False),
        sa.Column("end_user_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("turn_count", sa.Integer(), nullable=False),
        sa.Column("last_completion_id", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["end_user_id"], ["end_users.id"], name=op.f("fk_sessions_end_user_id_end_users"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        sa.UniqueConstraint("tenant_id", "session_key", name=op.f("uq_sessions_tenant_id_session_key")),
    )
    op.create_table(
        "completions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.String(length=64), nullable=True),
        sa.Column("end_user_id", sa.Integer(), nullable=True),
        sa.Column("session_id", sa.Integer(), nullable=True),
        sa.Column("turn_index", sa.Integer(), nullable=True),
        sa.Column("previous_completion_id", sa.String(length=64), nullable=True),
        sa.Column("request_messages", JSON, nullable=False),
        sa.Column("sampling_params", JSON, nullable=False),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("weight_version", sa.String(length=128), nullable=False),
        sa.Column("engine_replica", sa.String(length=256), nullable=False),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_keys.id"], name=op.f("fk_completions_api_key_id_api_keys"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["end_user_id"], ["end_users.id"], name=op.f("fk_completions_end_user_id_end_users"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["previous_completion_id"],
            ["completions.id"],
            name=op.f("fk_completions_previous_completion_id_completions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_completions_session_id_sessions"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_completions_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_completions")),
    )
    op.create_index("ix_completions_session_id_created_at", "completions", ["session_id", "created_at"], unique=False)
    op.create_index("ix_completions_tenant_id_created_at", "completions", ["tenant_id", "created_at"], unique=False)
    op.create_table(
        "completion_choices",
        sa.Column("completion_id", sa.String(length=64), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=False),
        sa.Column("weight_versions", JSON, nullable=False),
        sa.ForeignKeyConstraint(
            ["completion_id"],
            ["completions.id"],
            name=op.f("fk_completion_choices_completion_id_completions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("completion_id", "choice_index", name=op.f("pk_completion_choices")),
    )
    op.create_table(
        "feedback",
        sa.Column("completion_id", sa.String(length=64), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("score", sa.Double(), nullable=False),
        sa.Column("rating", sa.String(length=8), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("corrected_answer", sa.Text(), nullable=True),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("last_event_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["completion_id"],
            ["completions.id"],
            name=op.f("fk_feedback_completion_id_completions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_feedback_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("completion_id", "choice_index", name=op.f("pk_feedback")),
    )
    op.create_index("ix_feedback_updated_at", "feedback", ["updated_at"], unique=False)
    op.create_table(
        "feedback_events",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("completion_id", sa.String(length=64), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("score", sa.Double(), nullable=False),
        sa.Column("rating", sa.String(length=8), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("corrected_answer", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["completion_id"],
            ["completions.id"],
            name=op.f("fk_feedback_events_completion_id_completions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_feedback_events_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback_events")),
    )
    op.create_index(
        "ix_feedback_events_completion_id_choice_index",
        "feedback_events",
        ["completion_id", "choice_index"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_feedback_events_completion_id_choice_index", table_name="feedback_events")
    op.drop_table("feedback_events")
    op.drop_index("ix_feedback_updated_at", table_name="feedback")
    op.drop_table("feedback")
    op.drop_table("completion_choices")
    op.drop_index("ix_completions_tenant_id_created_at", table_name="completions")
    op.drop_index("ix_completions_session_id_created_at", table_name="completions")
    op.drop_table("completions")
    op.drop_table("sessions")
    op.drop_table("end_users")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
