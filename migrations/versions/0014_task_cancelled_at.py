"""A cancel is recorded as such: `tasks.cancelled_at` (a black-box test).

A cancelled task was recognised by its error message, `Task cancelled.`, which a function can
send too: a task its function failed with that message answered a cancel `200` (already
cancelled) instead of `409001`. The cancel sets `cancelled_at` in the transaction that ends the
task; rows cancelled before this revision get it from their message and end date, as they were
recognised before.

Adding a nullable column without a default is instant; the backfill, which reads the whole
table, runs once the column is committed (row locks only, while gateways run).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 06:10:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Committed before the backfill (which reads the whole table): the column's ACCESS
    # EXCLUSIVE lock held through it stalled the running gateways for seconds on a large table.
    op.execute("ALTER TABLE tasks ADD COLUMN IF NOT EXISTS cancelled_at timestamptz")
    with op.get_context().autocommit_block():
        op.execute(
            "UPDATE tasks SET cancelled_at = COALESCE(end_date, now())"
            " WHERE status = 'FAILURE' AND error_message = 'Task cancelled.'"
            " AND cancelled_at IS NULL"
        )


def downgrade() -> None:
    op.drop_column("tasks", "cancelled_at")
