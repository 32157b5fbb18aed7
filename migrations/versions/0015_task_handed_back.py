"""A hand-back read before its own `started` is kept: `tasks.handed_back_attempt`, `_at`.

Gateway replicas read `-out` side by side, so a dispatcher's `requeued` may be applied before
the `started` of the same attempt. It found the task PENDING and changed nothing; the `started`
then set it IN_PROGRESS while its message waited in `-in` again, and with no dispatcher to take
it (scaled to zero: when hand-backs happen) the watchdog failed a task that was still queued.
The `requeued` now leaves its attempt and time on the row, and that `started` records the
attempt as handed back instead of starting it (gateway/lifecycle.py).

Adding nullable columns without a default is instant.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30 02:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("handed_back_attempt", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("handed_back_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "handed_back_at")
    op.drop_column("tasks", "handed_back_attempt")
