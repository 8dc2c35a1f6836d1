"""A schedule the drift guard paused says why and since when, until an admin enables it again.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("training_schedules") as batch:
        batch.add_column(sa.Column("paused_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_schedules") as batch:
        batch.drop_column("paused_at")
        batch.drop_column("paused_reason")
