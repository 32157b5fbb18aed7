"""A PENDING task expires when its message does, whatever its service became (found by a sweep).

The reaper computed each task's time to live from the service's retention at the time of
its pass, while the task's message on `-in` carries the expiry it was published with.
Retention lowered by `admin apply`: tasks failed "expired" whose messages a dispatcher then
ran anyway. Raised: a task whose message had expired stayed PENDING for the new retention.
The row now keeps its message's expiry, and the reaper reads only the rows past it.

`ix_tasks_pending_expiry` takes the place of `ix_tasks_pending_since` (0009): a submission
writes as many index entries as before. Rows PENDING at the upgrade have no expiry yet; the
reaper gives them theirs from its own time to live on its next pass (a migration does not
know the gateway's `CONVEYOR_PENDING_TTL`). Adding the nullable column is instant; building
the partial index holds off writes as 0009's did (0.17 s at a million rows).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING = sa.text("status = 'PENDING'")


def upgrade() -> None:
    op.add_column("tasks", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_index("ix_tasks_pending_since", table_name="tasks")
    op.create_index("ix_tasks_pending_expiry", "tasks", ["expires_at"], postgresql_where=PENDING)


def downgrade() -> None:
    op.drop_index("ix_tasks_pending_expiry", table_name="tasks")
    op.create_index(
        "ix_tasks_pending_since",
        "tasks",
        [sa.text("COALESCE(not_before, submission_date)")],
        postgresql_where=PENDING,
    )
    op.drop_column("tasks", "expires_at")
