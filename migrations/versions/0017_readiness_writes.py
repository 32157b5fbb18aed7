"""A sequence that `/readyz` writes to: whether a commit goes through, not only a read.

With a synchronous standby away, every COMMIT waits for it, while a read does not: /readyz
said 200 for the whole outage as each submission waited DB_TIMEOUT for `503 503001` (found by
a black-box sweep of a PostgreSQL pair). `setval` on this sequence writes WAL in a
transaction of its own, whose commit waits for the standby as a submission's does; it holds no
row lock, so the gateways' probes never wait for one another.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30 17:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("CREATE SEQUENCE readiness_writes")


def downgrade() -> None:
    op.execute("DROP SEQUENCE IF EXISTS readiness_writes")
