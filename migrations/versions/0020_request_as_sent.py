"""The task's body as it was accepted: `tasks.request_json` (`json`, which keeps the text).

`request` is `jsonb`, which writes a number's exponent out in full and orders an object's keys
its own way: the relay, which publishes from the row, sent a body of 1e308s accepted at 0.9 MB
as 46 MB (its function refused it), `1.5e20` as the integer `150000000000000000000`, where the
same task published at once went out as sent (a black-box sweep). The relay now publishes
`request_json`. `request` is still written, for gateways of the previous release during a
rolling upgrade and for SQL that reads it; rows from before this revision have no
`request_json` and are published from `request`, as before.

Adding a nullable column without a default is instant.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02 01:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("request_json", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "request_json")
