"""Notify gateways when a task's status or progress changes (SPEC §11.3's event stream).

A row trigger sends `NOTIFY conveyor_task, '<taskId>'` for each change, however it was made (a
result, the reaper, the watchdog, a cancel, plain SQL); PostgreSQL delivers it at commit, once
per distinct payload in a transaction, to every gateway replica, whose one listening connection
wakes the streams of that task. The payload is only the id: a stream re-reads the task, so a
burst of changes costs one read per stream, not one per change.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 23:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION conveyor_task_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('conveyor_task', NEW.task_id::text);
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER tasks_changed AFTER UPDATE OF status, progress ON tasks FOR EACH ROW"
        " WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.progress IS DISTINCT FROM"
        " NEW.progress) EXECUTE FUNCTION conveyor_task_changed()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS tasks_changed ON tasks")
    op.execute("DROP FUNCTION IF EXISTS conveyor_task_changed()")
