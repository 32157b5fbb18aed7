"""Notify gateways when services or grants change, so they can cache them.

The gateway caches each (client, service) access it reads on the submission
path; these statement-level triggers send `NOTIFY conveyor_catalog` on any
change to `services` or `authorizations` (the admin CLI, `conveyor admin
apply`, or plain SQL), and every gateway drops its cache when it hears it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:05:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("services", "authorizations")


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION conveyor_catalog_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('conveyor_catalog', TG_TABLE_NAME);
            RETURN NULL;
        END $$
        """
    )
    for table in TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_catalog_changed"
            f" AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}"
            " FOR EACH STATEMENT EXECUTE FUNCTION conveyor_catalog_changed()"
        )


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_catalog_changed ON {table}")
    op.execute("DROP FUNCTION IF EXISTS conveyor_catalog_changed()")
