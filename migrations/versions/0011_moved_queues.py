"""The queue names services moved away from, recorded by the database (found by a sweep).

A service given another `queueName` still has dispatchers on its old queue finishing their
tasks and reporting on the old `-out`. Only a gateway that saw the move kept consuming it:
one started later (a deploy, a crash) knew the services' current queues only, and those
results waited until the watchdog failed their tasks. A trigger records every move, whoever
makes it (`admin apply`, the admin API, plain SQL); gateways consume what it lists until the
operator deletes the queues, and then forget the name. A service removed takes its records
with it: its queues are no longer consumed, as before.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 20:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "moved_queues",
        sa.Column("queue_name", sa.Text(), primary_key=True),
        sa.Column(
            "service",
            sa.Text(),
            sa.ForeignKey("services.name", ondelete="CASCADE", onupdate="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "moved_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.execute(
        """
        CREATE FUNCTION conveyor_queue_moved() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO moved_queues (queue_name, service) VALUES (OLD.queue_name, NEW.name)
            ON CONFLICT (queue_name) DO UPDATE
                SET service = EXCLUDED.service, moved_at = now();
            DELETE FROM moved_queues WHERE queue_name = NEW.queue_name;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER services_queue_moved AFTER UPDATE OF queue_name ON services"
        " FOR EACH ROW WHEN (OLD.queue_name IS DISTINCT FROM NEW.queue_name)"
        " EXECUTE FUNCTION conveyor_queue_moved()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS services_queue_moved ON services")
    op.execute("DROP FUNCTION IF EXISTS conveyor_queue_moved()")
    op.drop_table("moved_queues")
