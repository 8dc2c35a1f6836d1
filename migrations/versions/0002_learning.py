"""Learning: numbered feedback changes (the learner's watermark), model versions, training rounds.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
SEQUENCE_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_LOG_CHANGE = (
    "INSERT INTO feedback_changes (completion_id, choice_index, revision) "
    "VALUES (NEW.completion_id, NEW.choice_index, NEW.revision);"
)

# Triggers, not application code: every writer of ``feedback`` (any gateway, journal replays, a
# future admin tool) numbers its changes the same way. On SQLite a batch-mode ALTER of ``feedback``
# copies the table and drops these triggers: a later migration doing that must recreate them.
POSTGRES_TRIGGERS = (
    f"""CREATE FUNCTION tandem_log_feedback_change() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN {_LOG_CHANGE} RETURN NULL; END $$""",
    """CREATE TRIGGER trg_feedback_changes_insert AFTER INSERT ON feedback
    FOR EACH ROW EXECUTE FUNCTION tandem_log_feedback_change()""",
    """CREATE TRIGGER trg_feedback_changes_update AFTER UPDATE ON feedback
    FOR EACH ROW WHEN (NEW.revision IS DISTINCT FROM OLD.revision) EXECUTE FUNCTION tandem_log_feedback_change()""",
)
SQLITE_TRIGGERS = (
    f"CREATE TRIGGER trg_feedback_changes_insert AFTER INSERT ON feedback BEGIN {_LOG_CHANGE} END",
    f"""CREATE TRIGGER trg_feedback_changes_update AFTER UPDATE OF revision ON feedback
    WHEN NEW.revision <> OLD.revision BEGIN {_LOG_CHANGE} END""",
)


def upgrade() -> None:
    _create_feedback_changes()
    _create_model_versions()
    _create_training_rounds()


def downgrade() -> None:
    op.drop_index("uq_training_rounds_model_running", table_name="training_rounds")
    op.drop_index("ix_training_rounds_model_created_at", table_name="training_rounds")
    op.drop_table("training_rounds")
    op.drop_index("uq_model_versions_model_serving", table_name="model_versions")
    op.drop_index("ix_model_versions_model_created_at", table_name="model_versions")
    op.drop_table("model_versions")
    op.execute("DROP TRIGGER IF EXISTS trg_feedback_changes_update" + _on_feedback())
    op.execute("DROP TRIGGER IF EXISTS trg_feedback_changes_insert" + _on_feedback())
    if _dialect() == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS tandem_log_feedback_change()")
    op.drop_index("ix_feedback_changes_completion_id_choice_index", table_name="feedback_changes")
    op.drop_table("feedback_changes")


def _dialect() -> str:
    return op.get_bind().dialect.name


def _on_feedback() -> str:
    return " ON feedback" if _dialect() == "postgresql" else ""


def _create_feedback_changes() -> None:
    op.create_table(
        "feedback_changes",
        sa.Column("seq", SEQUENCE_INT, autoincrement=True, nullable=False),
        sa.Column("completion_id", sa.String(length=64), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["completion_id", "choice_index"],
            ["feedback.completion_id", "feedback.choice_index"],
            name="fk_feedback_changes_feedback",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_feedback_changes")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_feedback_changes_completion_id_choice_index",
        "feedback_changes",
        ["completion_id", "choice_index"],
        unique=False,
    )
    # Feedback stored before this migration is numbered once, oldest first, so no round misses it.
    op.execute(
        "INSERT INTO feedback_changes (completion_id, choice_index, revision) "
        "SELECT completion_id, choice_index, revision FROM feedback ORDER BY updated_at, completion_id, choice_index"
    )
    for statement in POSTGRES_TRIGGERS if _dialect() == "postgresql" else SQLITE_TRIGGERS:
        op.execute(statement)


def _create_model_versions() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("parent_id", sa.String(length=128), nullable=True),
        sa.Column("checkpoint_path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("watermark", sa.BigInteger(), nullable=True),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("evaluation", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('candidate', 'serving', 'retired', 'rejected')", name=op.f("ck_model_versions_status")
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["model_versions.id"],
            name=op.f("fk_model_versions_parent_id_model_versions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
    )
    op.create_index("ix_model_versions_model_created_at", "model_versions", ["model", "created_at"], unique=False)
    serving = sa.text("status = 'serving'")
    op.create_index(
        "uq_model_versions_model_serving",
        "model_versions",
        ["model"],
        unique=True,
        postgresql_where=serving,
        sqlite_where=serving,
    )


def _create_training_rounds() -> None:
    op.create_table(
        "training_rounds",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("base_version_id", sa.String(length=128), nullable=True),
        sa.Column("produced_version_id", sa.String(length=128), nullable=True),
        sa.Column("watermark_from", sa.BigInteger(), nullable=True),
        sa.Column("watermark_to", sa.BigInteger(), nullable=True),
        sa.Column("samples_collected", sa.Integer(), nullable=True),
        sa.Column("samples_trained", sa.Integer(), nullable=True),
        sa.Column("config", JSON, nullable=False),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker_id", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_training_rounds_status"),
        ),
        sa.CheckConstraint("trigger IN ('schedule', 'manual')", name=op.f("ck_training_rounds_trigger")),
        sa.ForeignKeyConstraint(
            ["base_version_id"],
            ["model_versions.id"],
            name=op.f("fk_training_rounds_base_version_id_model_versions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["produced_version_id"],
            ["model_versions.id"],
            name=op.f("fk_training_rounds_produced_version_id_model_versions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_rounds")),
    )
    op.create_index("ix_training_rounds_model_created_at", "training_rounds", ["model", "created_at"], unique=False)
    running = sa.text("status = 'running'")
    op.create_index(
        "uq_training_rounds_model_running",
        "training_rounds",
        ["model"],
        unique=True,
        postgresql_where=running,
        sqlite_where=running,
    )
