"""Count each service's PENDING tasks as they change, instead of at every submission.

A submission's `taskPosition` and the capacity checks counted the service's PENDING rows,
every one of them, and so did a poll of a PENDING task, for the tasks ahead of it: with
50,000 PENDING tasks a submission took 12 ms of PostgreSQL's time (bench.scale's deep
backlog), and a burst that deep is what KEDA scales on. Now triggers keep two tables of
counts up to date in the transaction that changes a task, however it changes (the intake, a
result, the reaper, a cancel, the purge, plain SQL), and those reads sum a few rows:

* `task_backlog`: every PENDING task, per service, client and shard: the capacity checks;
* `task_backlog_blocks`: the PENDING tasks without a `notBefore`, per service, block of
  1,024 row ids and shard: a submission's position is all of the service's blocks, a
  PENDING task's the blocks before its own plus what its own block holds ahead of it (at
  most 1,024 rows). A run-later task counts in a position only once due, which no trigger
  can see happen: those few are counted live (`ix_tasks_pending_later`).

The shard is the writing backend's pid: a transaction only ever changes its own backend's
rows, so two transactions never wait for each other's counts (the intake adds while the
results consumer subtracts, and gateway replicas apply events at once) and can never
deadlock on them. The reaper merges those rows into shard -1, which no backend writes, and
deletes what sums to zero, so the rows do not pile up with connections and drained blocks
(`housekeeping.compact_backlog`). A shard may go negative; only sums mean anything.

Creating the index and the triggers locks out writers until the migration commits, so the
counts taken here and the triggers' later changes add up exactly.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 07:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BLOCK_BITS = 10  # 1,024 row ids a block: `gateway.store` reads blocks of the same size
SHARD = "pg_backend_pid()"  # -1: the reaper's merged counts (housekeeping.compact_backlog)


def upgrade() -> None:
    op.create_table(
        "task_backlog",
        sa.Column("service", sa.Text(), nullable=False),
        sa.Column("client_id", sa.Text(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("pending", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("service", "client_id", "shard"),
    )
    op.create_table(
        "task_backlog_blocks",
        sa.Column("service", sa.Text(), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("pending", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("service", "block", "shard"),
    )
    op.create_index(
        "ix_tasks_pending_later",
        "tasks",
        ["service", "not_before"],
        postgresql_where=sa.text("status = 'PENDING' AND not_before IS NOT NULL"),
        postgresql_include=["id"],
    )
    op.execute(
        f"""
        CREATE FUNCTION conveyor_backlog_added() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_backlog AS b (service, client_id, shard, pending)
            SELECT service, client_id, {SHARD}, count(*)
              FROM added WHERE status = 'PENDING'
             GROUP BY 1, 2
            ON CONFLICT (service, client_id, shard)
            DO UPDATE SET pending = b.pending + EXCLUDED.pending;
            INSERT INTO task_backlog_blocks AS b (service, block, shard, pending)
            SELECT service, id >> {BLOCK_BITS}, {SHARD}, count(*)
              FROM added WHERE status = 'PENDING' AND not_before IS NULL
             GROUP BY 1, 2
            ON CONFLICT (service, block, shard) DO UPDATE SET pending = b.pending + EXCLUDED.pending;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        f"""
        CREATE FUNCTION conveyor_backlog_count(task tasks, delta int) RETURNS void
        LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_backlog AS b (service, client_id, shard, pending)
            VALUES (task.service, task.client_id, {SHARD}, delta)
            ON CONFLICT (service, client_id, shard)
            DO UPDATE SET pending = b.pending + delta;
            IF task.not_before IS NULL THEN
                INSERT INTO task_backlog_blocks AS b (service, block, shard, pending)
                VALUES (task.service, task.id >> {BLOCK_BITS}, {SHARD}, delta)
                ON CONFLICT (service, block, shard) DO UPDATE SET pending = b.pending + delta;
            END IF;
        END $$
        """
    )
    # Per statement, not per row: a batch of results moves its tasks out of the backlog with
    # one change of each count it touches. Rows that stay PENDING (or stay out) cancel out.
    op.execute(
        f"""
        CREATE FUNCTION conveyor_backlog_updated() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_backlog AS b (service, client_id, shard, pending)
            SELECT service, client_id, {SHARD}, sum(delta)
              FROM (SELECT service, client_id, -1 AS delta FROM old_rows WHERE status = 'PENDING'
                    UNION ALL
                    SELECT service, client_id, 1 FROM new_rows WHERE status = 'PENDING') AS moved
             GROUP BY 1, 2 HAVING sum(delta) <> 0
            ON CONFLICT (service, client_id, shard)
            DO UPDATE SET pending = b.pending + EXCLUDED.pending;
            INSERT INTO task_backlog_blocks AS b (service, block, shard, pending)
            SELECT service, block, {SHARD}, sum(delta)
              FROM (SELECT service, id >> {BLOCK_BITS} AS block, -1 AS delta FROM old_rows
                     WHERE status = 'PENDING' AND not_before IS NULL
                    UNION ALL
                    SELECT service, id >> {BLOCK_BITS}, 1 FROM new_rows
                     WHERE status = 'PENDING' AND not_before IS NULL) AS moved
             GROUP BY 1, 2 HAVING sum(delta) <> 0
            ON CONFLICT (service, block, shard) DO UPDATE SET pending = b.pending + EXCLUDED.pending;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        """
        CREATE FUNCTION conveyor_backlog_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM conveyor_backlog_count(OLD, -1);
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        """
        CREATE FUNCTION conveyor_backlog_emptied() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            TRUNCATE task_backlog, task_backlog_blocks;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER tasks_backlog_added AFTER INSERT ON tasks"
        " REFERENCING NEW TABLE AS added FOR EACH STATEMENT"
        " EXECUTE FUNCTION conveyor_backlog_added()"
    )
    op.execute(
        "CREATE TRIGGER tasks_backlog_updated AFTER UPDATE ON tasks"
        " REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT"
        " EXECUTE FUNCTION conveyor_backlog_updated()"
    )
    # The purge deletes finished tasks by thousands: only a PENDING one runs the function.
    op.execute(
        "CREATE TRIGGER tasks_backlog_deleted AFTER DELETE ON tasks FOR EACH ROW"
        " WHEN (OLD.status = 'PENDING') EXECUTE FUNCTION conveyor_backlog_deleted()"
    )
    op.execute(
        "CREATE TRIGGER tasks_backlog_truncated AFTER TRUNCATE ON tasks"
        " FOR EACH STATEMENT EXECUTE FUNCTION conveyor_backlog_emptied()"
    )
    op.execute(
        """
        INSERT INTO task_backlog (service, client_id, shard, pending)
        SELECT service, client_id, -1, count(*) FROM tasks WHERE status = 'PENDING' GROUP BY 1, 2
        """
    )
    op.execute(
        f"""
        INSERT INTO task_backlog_blocks (service, block, shard, pending)
        SELECT service, id >> {BLOCK_BITS}, -1, count(*)
          FROM tasks WHERE status = 'PENDING' AND not_before IS NULL GROUP BY 1, 2
        """
    )


def downgrade() -> None:
    for trigger in ("added", "updated", "deleted", "truncated"):
        op.execute(f"DROP TRIGGER IF EXISTS tasks_backlog_{trigger} ON tasks")
    for function in ("added()", "updated()", "deleted()", "emptied()", "count(tasks, int)"):
        op.execute(f"DROP FUNCTION IF EXISTS conveyor_backlog_{function}")
    op.drop_index("ix_tasks_pending_later", table_name="tasks")
    op.drop_table("task_backlog_blocks")
    op.drop_table("task_backlog")
