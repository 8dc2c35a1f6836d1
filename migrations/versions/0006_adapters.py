"""LoRA adapters per scope (user, cohort, tenant), cohort membership, and the adapter each completion used.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("scope_kind", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=256), nullable=False),
        sa.Column("base_version_id", sa.String(length=128), nullable=True),
        sa.Column("parent_id", sa.String(length=128), nullable=True),
        sa.Column("checkpoint_path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("watermark", sa.BigInteger(), nullable=True),
        sa.Column("ratings", sa.Integer(), nullable=False),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("evaluation", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('candidate', 'serving', 'retired', 'rejected')", name=op.f("ck_adapters_status")
        ),
        sa.CheckConstraint("scope_kind IN ('user', 'cohort', 'tenant')", name=op.f("ck_adapters_scope_kind")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_adapters_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["adapters.id"], name=op.f("fk_adapters_parent_id_adapters"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
    )
    op.create_index(
        "ix_adapters_tenant_id_scope_kind_scope", "adapters", ["tenant_id", "scope_kind", "scope"], unique=False
    )
    serving = sa.text("status = 'serving'")
    op.create_index(
        "uq_adapters_model_tenant_id_scope_kind_scope_serving",
        "adapters",
        ["model", "tenant_id", "scope_kind", "scope"],
        unique=True,
        postgresql_where=serving,
        sqlite_where=serving,
    )
    op.create_table(
        "cohort_members",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("end_user", sa.String(length=256), nullable=False),
        sa.Column("cohort", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_cohort_members_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "end_user", name=op.f("pk_cohort_members")),
    )
    op.create_index("ix_cohort_members_tenant_id_cohort", "cohort_members", ["tenant_id", "cohort"], unique=False)
    op.add_column("completions", sa.Column("adapter_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as completions:  # SQLite rebuilds the table to drop a column
        completions.drop_column("adapter_id")
    op.drop_index("ix_cohort_members_tenant_id_cohort", table_name="cohort_members")
    op.drop_table("cohort_members")
    op.drop_index("uq_adapters_model_tenant_id_scope_kind_scope_serving", table_name="adapters")
    op.drop_index("ix_adapters_tenant_id_scope_kind_scope", table_name="adapters")
    op.drop_table("adapters")
