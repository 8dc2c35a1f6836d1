"""Training schedules and their claimed firing slots; per-user data deletions; rounds name their schedule.

A firing slot is claimed by inserting ``(schedule_id, slot)``: the primary key is what keeps two beat
processes from firing the same slot twice. A data deletion is kept as a tombstone: writes replayed
later from the local journal for that user (made before the deletion) are dropped, and the record
says who deleted what.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
SEQUENCE_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "training_schedules",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("cron", sa.String(length=120), nullable=True),
        sa.Column("interval_s", sa.Integer(), nullable=True),
        sa.Column("min_feedback", sa.Integer(), nullable=True),
        sa.Column("quiet_start", sa.String(length=5), nullable=True),
        sa.Column("quiet_end", sa.String(length=5), nullable=True),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("round_settings", JSON, nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("updated_at", TIME, nullable=False),
        sa.CheckConstraint("kind IN ('cron', 'interval', 'feedback')", name=op.f("ck_training_schedules_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_schedules")),
        sa.UniqueConstraint("name", name=op.f("uq_training_schedules_name")),
    )
    op.create_table(
        "schedule_firings",
        sa.Column("schedule_id", sa.String(length=64), nullable=False),
        sa.Column("slot", sa.String(length=64), nullable=False),
        sa.Column("fired_at", TIME, nullable=False),
        sa.Column("task_id", sa.String(length=64), nullable=True),
        sa.Column("beat", sa.String(length=256), nullable=True),
        sa.ForeignKeyConstraint(
            ["schedule_id"],
            ["training_schedules.id"],
            name=op.f("fk_schedule_firings_schedule_id_training_schedules"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("schedule_id", "slot", name=op.f("pk_schedule_firings")),
    )
    op.create_index("ix_schedule_firings_fired_at", "schedule_firings", ["fired_at"], unique=False)
    op.create_table(
        "data_deletions",
        sa.Column("id", SEQUENCE_INT, autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("end_user", sa.String(length=256), nullable=False),
        sa.Column("deleted_at", TIME, nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("counts", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_data_deletions")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_data_deletions_tenant_id_end_user", "data_deletions", ["tenant_id", "end_user"], unique=False)
    op.add_column("training_rounds", sa.Column("schedule_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_rounds") as batch:
        batch.drop_column("schedule_id")
    op.drop_index("ix_data_deletions_tenant_id_end_user", table_name="data_deletions")
    op.drop_table("data_deletions")
    op.drop_index("ix_schedule_firings_fired_at", table_name="schedule_firings")
    op.drop_table("schedule_firings")
    op.drop_table("training_schedules")
