"""The watchdog waits as long as the task's own message allows (found by a black-box test).

The watchdog failed an IN_PROGRESS task once its worker had been silent for the service's
`taskTimeout` times `maxAttempts`, read at the time of the check. A service whose timeout was
lowered by `admin apply` then failed tasks that were running correctly under the timeout
their message carried. The row now keeps the figure its message was published with.

Adding a nullable column without a default changes no row: instant at any size.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 18:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("time_limit", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "time_limit")
