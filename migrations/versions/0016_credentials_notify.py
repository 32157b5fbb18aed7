"""Notify gateways when clients or operators change, so a verified secret is forgotten at once.

Each gateway process keeps the secrets it verified (bcrypt costs ~0.25 s a check). These
statement-level triggers send `NOTIFY conveyor_credentials` with the table's name on any change
to `clients` or `operators` (the admin CLI, `conveyor admin apply`, or plain SQL), and every
gateway forgets that table's verified secrets when it hears it: a deleted client or operator,
or a changed secret, is refused by the next request instead of once a cache expires.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30 06:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("clients", "operators")


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION conveyor_credentials_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('conveyor_credentials', TG_TABLE_NAME);
            RETURN NULL;
        END $$
        """
    )
    for table in TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_credentials_changed"
            f" AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}"
            " FOR EACH STATEMENT EXECUTE FUNCTION conveyor_credentials_changed()"
        )


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_credentials_changed ON {table}")
    op.execute("DROP FUNCTION IF EXISTS conveyor_credentials_changed()")
