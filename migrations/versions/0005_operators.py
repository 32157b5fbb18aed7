"""Operators (SPEC §11.6) and the indexes the admin API reads through.

Operators live in a table of their own: an id in `clients` is never an
operator, and an operator's secret never opens the consumer API. The admin
API lists a service's tasks newest first (`ix_tasks_service_id`) and counts
the running ones (`ix_tasks_running`, partial: its size follows the tasks
running now, not the history). `ix_tasks_finished` grows the outcome and the
start date as included columns, so that counts by outcome, throughput and
run-time percentiles over a window are index-only scans.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operators",
        sa.Column("operator_id", sa.Text(), primary_key=True),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    _finished(include=["status", "start_date"])
    op.create_index("ix_tasks_service_id", "tasks", ["service", "id"])
    op.create_index(
        "ix_tasks_running",
        "tasks",
        ["service"],
        postgresql_where=sa.text("status = 'IN_PROGRESS'"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_running", table_name="tasks")
    op.drop_index("ix_tasks_service_id", table_name="tasks")
    op.drop_table("operators")
    _finished(include=None)


def _finished(include: list[str] | None) -> None:
    op.drop_index("ix_tasks_finished", table_name="tasks")
    op.create_index(
        "ix_tasks_finished",
        "tasks",
        ["service", "end_date"],
        postgresql_where=sa.text("status IN ('SUCCESS', 'FAILURE')"),
        postgresql_include=include,
    )
