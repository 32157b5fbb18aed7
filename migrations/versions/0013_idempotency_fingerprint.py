"""An Idempotency-Key means one request: the key is kept with a fingerprint of it (an audit).

A key answered whatever came with it: a repeat with another body got the first task (200)
silently, and a batch with as many items as the first its ids; a key used for a batch and then
for a single task (or the reverse) made two tasks. Each row written under a key now keeps the
SHA-256 of its request in canonical JSON (`gateway.store.fingerprint`; a batch's, the whole
batch's, on each of its rows), and a key reused for another request is refused (`400002`).
Rows written before have none, and are taken as matching any request, as before.

Adding a nullable column without a default is instant, whatever the table's size.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("idempotency_fingerprint", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "idempotency_fingerprint")
