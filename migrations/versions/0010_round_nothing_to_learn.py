"""Rounds that consumed their data but could not change the policy: status ``nothing_to_learn`` and why.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = ("queued", "running", "succeeded", "failed", "cancelled")
_AFTER = ("queued", "running", "succeeded", "nothing_to_learn", "failed", "cancelled")


def _status_check(statuses: tuple[str, ...]) -> str:
    return f"status IN ({', '.join(repr(s) for s in statuses)})"


def upgrade() -> None:
    with op.batch_alter_table("training_rounds") as batch:  # SQLite rebuilds the table to change a check
        batch.drop_constraint("status", type_="check")
        batch.create_check_constraint("status", _status_check(_AFTER))
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))


def downgrade() -> None:
    # Such a round consumed its data: before this revision that was a succeeded round without a version.
    op.execute("UPDATE training_rounds SET status = 'succeeded' WHERE status = 'nothing_to_learn'")
    with op.batch_alter_table("training_rounds") as batch:
        batch.drop_column("reason")
        batch.drop_constraint("status", type_="check")
        batch.create_check_constraint("status", _status_check(_BEFORE))
