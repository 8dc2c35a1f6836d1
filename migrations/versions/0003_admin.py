"""Admin: the audit log of every admin action (who, what, on which target, with what outcome).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
SEQUENCE_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "admin_audit_log",
        sa.Column("id", SEQUENCE_INT, autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=True),
        sa.Column("details", JSON, nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_audit_log")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_admin_audit_log_at", "admin_audit_log", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_admin_audit_log_at", table_name="admin_audit_log")
    op.drop_table("admin_audit_log")
