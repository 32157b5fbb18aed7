"""The task row is the outbox (issue 12): `tasks.publish_at` replaces the `outbox` table.

A submission used to write two rows (the task and its outbox entry, with a foreign-key
check) and, once the broker confirmed, delete one. Now the task row itself says that it is
still to be published: `publish_at` is when the relay may take it (the fast path's grace
past the submission, or a run-later task's `notBefore`); NULL once it is published, started
or ended. A partial index holds only those rows, so the relay's claim costs nothing for the
history, and the first event from a dispatcher clears the column in the update it makes
anyway.

Existing outbox rows move onto their tasks, due at once (their fast path is long over) or at
their `not_before`; downgrade moves them back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("publish_at", sa.DateTime(timezone=True)))
    op.add_column(
        "tasks",
        sa.Column("publish_attempts", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column("tasks", sa.Column("publish_error", sa.Text()))
    op.execute(
        """
        UPDATE tasks t
           SET publish_at = COALESCE(o.not_before, now()), publish_attempts = o.attempts,
               publish_error = o.last_error
          FROM outbox o
         WHERE o.task_id = t.task_id AND t.status = 'PENDING'
        """
    )
    op.create_index(
        "ix_tasks_unpublished",
        "tasks",
        ["publish_at", "id"],
        postgresql_where=sa.text("publish_at IS NOT NULL"),
    )
    op.drop_table("outbox")


def downgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("not_before", sa.DateTime(timezone=True)),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.task_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_outbox_task_id"), "outbox", ["task_id"], unique=False)
    op.create_index(
        "ix_outbox_now", "outbox", ["id"], postgresql_where=sa.text("not_before IS NULL")
    )
    op.create_index(
        "ix_outbox_later",
        "outbox",
        ["not_before", "id"],
        postgresql_where=sa.text("not_before IS NOT NULL"),
    )
    op.execute(
        """
        INSERT INTO outbox (task_id, attempts, last_error, not_before)
        SELECT task_id, publish_attempts, publish_error,
               CASE WHEN not_before > now() THEN not_before END
          FROM tasks WHERE publish_at IS NOT NULL ORDER BY id
        """
    )
    op.drop_index("ix_tasks_unpublished", table_name="tasks")
    op.drop_column("tasks", "publish_error")
    op.drop_column("tasks", "publish_attempts")
    op.drop_column("tasks", "publish_at")
