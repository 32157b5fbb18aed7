"""Cancels not told to the dispatchers yet, kept by the database: `untold_cancels`.

A cancel the broker did not take (an outage) was kept in the memory of the gateway process
that answered it: a process that ended before the broker came back took it along, and the
function then ran; `conveyor admin service delete` during an outage kept none (a sweep: its
50 tasks' functions were called once the broker was back). A row is written with the change
that ends the task (a cancel, a delete) and removed once the broker took the broadcast; any
gateway tells what is left (`gateway.cancel.Broadcast`). The row names the queue names to
tell, so a deleted service's cancels still reach its dispatchers.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01 05:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, UUID

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "untold_cancels",
        sa.Column("task_id", UUID(as_uuid=True), primary_key=True),
        sa.Column("service", sa.Text(), nullable=False),
        sa.Column("queue_names", ARRAY(sa.Text()), nullable=False),
        sa.Column(
            "retry_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("ix_untold_cancels_retry_at", "untold_cancels", ["retry_at"])


def downgrade() -> None:
    op.drop_table("untold_cancels")
