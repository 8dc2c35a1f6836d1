"""Canary rollouts of adapters and base versions: the split, its decision, and which side served each completion.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "canaries",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=True),
        sa.Column("scope_kind", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=256), nullable=False),
        sa.Column("candidate_id", sa.String(length=128), nullable=False),
        sa.Column("control_id", sa.String(length=128), nullable=True),
        sa.Column("share", sa.Double(), nullable=False),
        sa.Column("rules", JSON, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("numbers", JSON, nullable=False),
        sa.Column("started_by", sa.String(length=64), nullable=False),
        sa.Column("decided_by", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'promoted', 'rolled_back', 'superseded')", name=op.f("ck_canaries_status")
        ),
        sa.CheckConstraint("(scope_kind = 'base') = (tenant_id IS NULL)", name=op.f("ck_canaries_base_spans_tenants")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_canaries_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_canaries")),
    )
    running = sa.text("status = 'running'")
    op.create_index(
        "uq_canaries_model_tenant_id_scope_kind_scope_running",
        "canaries",
        ["model", "tenant_id", "scope_kind", "scope"],
        unique=True,
        postgresql_where=running,
        sqlite_where=running,
    )
    running_base = sa.text("status = 'running' AND scope_kind = 'base'")
    op.create_index(
        "uq_canaries_model_base_running",
        "canaries",
        ["model"],
        unique=True,
        postgresql_where=running_base,
        sqlite_where=running_base,
    )
    op.add_column("completions", sa.Column("canary_id", sa.String(length=64), nullable=True))
    op.add_column("completions", sa.Column("canary_arm", sa.String(length=8), nullable=True))
    op.create_index(op.f("ix_completions_canary_id"), "completions", ["canary_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_completions_canary_id"), table_name="completions")
    with op.batch_alter_table("completions") as completions:  # SQLite rebuilds the table to drop a column
        completions.drop_column("canary_arm")
        completions.drop_column("canary_id")
    op.drop_index("uq_canaries_model_base_running", table_name="canaries")
    op.drop_index("uq_canaries_model_tenant_id_scope_kind_scope_running", table_name="canaries")
    op.drop_table("canaries")
