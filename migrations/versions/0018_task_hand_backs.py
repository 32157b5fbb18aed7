"""Every hand-back read before its own `started` is kept: `tasks.handed_back`.

Migration 0015 kept one (`handed_back_attempt`, `_at`). Two attempts handed back one after the
other, both `requeued` read before their `started` (replicas read `-out` side by side), left
only the second: the first attempt's `started` then set the task IN_PROGRESS while its message
waited in `-in`, where the watchdog failed it (a sweep: 2 of 24 orders). `handed_back` maps
each such attempt to its hand-back's time until its `started` records it; the 0015 columns
are still written (the last one) and read, for gateways of the previous release during a
rolling upgrade.

Adding a nullable column without a default is instant.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01 02:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("handed_back", JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "handed_back")
