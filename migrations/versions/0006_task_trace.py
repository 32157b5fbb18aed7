"""Each task keeps its W3C `traceparent` (SPEC §11.6, tracing).

The gateway's spans after the submission (the result applied, the callback sent) belong to the
task's trace, which no message carries back to them: the row does. Nullable, no default and no
index: adding it rewrites nothing, and nothing searches by it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "traceparent")
