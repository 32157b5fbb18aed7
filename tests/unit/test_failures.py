"""What an operator is told when a command meets a database it cannot use (conveyor.cli.failures)."""

from __future__ import annotations

import psycopg
import sqlalchemy.exc

from conveyor.cli.failures import explain


def test_a_migration_locked_out_says_what_to_do_in_one_line() -> None:
    """Found by a black-box sweep: `conveyor db upgrade` that gave up waiting for a table's
    lock (a long transaction held it through its 6 tries) ended in 140 lines, two tracebacks
    of SQLAlchemy's wrapping of psycopg's LockNotAvailable."""
    locked = psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")
    wrapped = sqlalchemy.exc.OperationalError(
        "ALTER TABLE tasks ADD COLUMN IF NOT EXISTS cancelled_at timestamptz", {}, locked
    )
    for exc in (wrapped, locked):
        line = explain(exc)
        assert line is not None and "\n" not in line
        assert "lock" in line and "again" in line, line


def test_a_wrapped_connection_failure_is_one_line_too() -> None:
    refused = psycopg.OperationalError("connection refused\nis the server running?")
    wrapped = sqlalchemy.exc.OperationalError("SELECT 1", {}, refused)
    assert explain(wrapped) == "cannot use the database: connection refused"
