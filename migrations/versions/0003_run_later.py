"""Run later (SPEC §11.4): a task may wait for its `notBefore` time before it is published.

`tasks.not_before` is what the poll shows; `outbox.not_before` is when the relay may publish
the row. The relay finds due rows on their own partial index, so a million tasks waiting for
next month cost the relay nothing, and the rows to publish now keep theirs. The PENDING index
carries `not_before`, so that a task's position counts only due tasks from the index alone.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 23:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("not_before", sa.DateTime(timezone=True)))
    op.add_column("outbox", sa.Column("not_before", sa.DateTime(timezone=True)))
    op.drop_index("ix_tasks_pending", table_name="tasks")
    op.create_index(
        "ix_tasks_pending",
        "tasks",
        ["service", "id"],
        postgresql_where=sa.text("status = 'PENDING'"),
        postgresql_include=["not_before"],
    )
    op.create_index(
        "ix_outbox_now", "outbox", ["id"], postgresql_where=sa.text("not_before IS NULL")
    )
    op.create_index(
        "ix_outbox_later",
        "outbox",
        ["not_before", "id"],
        postgresql_where=sa.text("not_before IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_later", table_name="outbox")
    op.drop_index("ix_outbox_now", table_name="outbox")
    op.drop_index("ix_tasks_pending", table_name="tasks")
    op.create_index(
        "ix_tasks_pending",
        "tasks",
        ["service", "id"],
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.drop_column("outbox", "not_before")
    op.drop_column("tasks", "not_before")
