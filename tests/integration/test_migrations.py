"""Alembic is the only way the schema changes: upgrade, downgrade to base, upgrade again.

Runs on a database created for the test (never the session's), and checks the
result in PostgreSQL's catalogue, not through the migration tool's own view.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest
from sqlalchemy import create_engine

from gateway.database_url import libpq
from gateway.migrate import alembic_config, downgrade, drop_database, upgrade
from gateway.models import metadata
from tests.support.amqp import scratch_database
from tests.support.processes import REPO

TABLES = {
    "services",
    "clients",
    "operators",
    "authorizations",
    "tasks",
    "task_attempts",
    "task_backlog",
    "task_backlog_blocks",
    "poison_messages",
    "moved_queues",
    "untold_cancels",
}
INDEXES = {
    "ix_tasks_pending",
    "ix_tasks_pending_expiry",
    "ux_tasks_idempotency",
    "ix_tasks_notify",
    "ix_tasks_finished",
    "ix_tasks_submission_date",
    "ix_tasks_service_id",
    "ix_tasks_running",
    "ix_tasks_unpublished",
    "ix_tasks_pending_later",
    "ix_untold_cancels_retry_at",
}


def _tables(url: str) -> set[str]:
    with psycopg.connect(libpq(url)) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r[0] for r in rows} - {"alembic_version"}


def _indexes(url: str) -> dict[str, str]:
    with psycopg.connect(libpq(url)) as conn:
        rows = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
        )
        return {name: definition for name, definition in rows}


def _assert_full_schema(url: str) -> None:
    assert _tables(url) == TABLES
    indexes = _indexes(url)
    assert INDEXES <= set(indexes), sorted(INDEXES - set(indexes))
    # The PENDING indexes are partial: their size follows the backlog, not the history.
    assert "WHERE (status = 'PENDING'::text)" in indexes["ix_tasks_pending"]
    assert "UNIQUE" in indexes["ux_tasks_idempotency"]


@pytest.mark.timeout(60)
def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    with scratch_database(database_url, migrate=False) as url:
        upgrade(url)
        _assert_full_schema(url)

        downgrade(url, "base")
        assert _tables(url) == set()
        assert set(_indexes(url)) & INDEXES == set()

        upgrade(url)
        _assert_full_schema(url)


@pytest.mark.timeout(60)
def test_migrations_match_the_models(database_url: str) -> None:
    """The tables the code queries (gateway.models) are the ones the migrations build."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    with scratch_database(database_url) as url:
        engine = create_engine(alembic_config(url).get_main_option("sqlalchemy.url"))
        try:
            with engine.connect() as conn:
                diff = compare_metadata(MigrationContext.configure(conn), metadata)
        finally:
            engine.dispose()
    assert diff == []


@pytest.mark.timeout(60)
def test_outbox_rows_move_onto_their_tasks_and_back(database_url: str) -> None:
    """0007: what was waiting in `outbox` is still to be published on its task row, due at
    once or at its notBefore; downgrade puts it back in `outbox`."""
    with scratch_database(database_url, migrate=False) as url:
        upgrade(url, "0006")
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO services (name, queue_name) VALUES ('s', 's') ON CONFLICT DO NOTHING"
            )
            conn.execute("INSERT INTO clients (client_id, secret_hash) VALUES ('c', 'x')")
            conn.execute(
                """
                INSERT INTO tasks (task_id, client_id, service, request, status, not_before)
                VALUES ('00000000-0000-0000-0000-000000000001', 'c', 's', '{}', 'PENDING', NULL),
                       ('00000000-0000-0000-0000-000000000002', 'c', 's', '{}', 'PENDING',
                        now() + interval '1 day'),
                       ('00000000-0000-0000-0000-000000000003', 'c', 's', '{}', 'SUCCESS', NULL)
                """
            )
            conn.execute(
                """
                INSERT INTO outbox (task_id, not_before, attempts, last_error)
                VALUES ('00000000-0000-0000-0000-000000000001', NULL, 2, 'broker down'),
                       ('00000000-0000-0000-0000-000000000002', now() + interval '1 day', 0, NULL)
                """
            )
        upgrade(url)
        with psycopg.connect(libpq(url)) as conn:
            rows = conn.execute(
                "SELECT right(task_id::text, 1), publish_at <= now(), publish_at > now(),"
                " publish_attempts, publish_error FROM tasks ORDER BY task_id"
            ).fetchall()
        assert rows == [
            ("1", True, False, 2, "broker down"),
            ("2", False, True, 0, None),
            ("3", None, None, 0, None),
        ]
        downgrade(url, "0006")
        with psycopg.connect(libpq(url)) as conn:
            back = conn.execute(
                "SELECT right(task_id::text, 1), not_before IS NOT NULL, attempts, last_error"
                " FROM outbox ORDER BY task_id"
            ).fetchall()
        assert back == [("1", False, 2, "broker down"), ("2", True, 0, None)]


@pytest.mark.timeout(60)
def test_the_backlog_is_counted_from_the_rows_already_there(database_url: str) -> None:
    """0008: an installation upgraded with tasks PENDING starts with their counts, and the
    triggers carry them on from there."""
    with scratch_database(database_url, migrate=False) as url:
        upgrade(url, "0007")
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(
                """
                INSERT INTO tasks (task_id, client_id, service, request, status, not_before)
                SELECT gen_random_uuid(), 'c' || (g % 2), 's', '{}',
                       CASE WHEN g % 5 = 0 THEN 'SUCCESS' ELSE 'PENDING' END,
                       CASE WHEN g % 3 = 0 THEN now() + interval '1 day' END
                  FROM generate_series(1, 30) AS g
                """
            )
        upgrade(url)
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            assert _backlog(conn) == _live_backlog(conn)
            assert sum(_backlog(conn).values()) == 24
            blocks = conn.execute("SELECT sum(pending) FROM task_backlog_blocks").fetchone()
            assert blocks is not None and blocks[0] == 16  # without a notBefore
            conn.execute("UPDATE tasks SET status = 'FAILURE' WHERE client_id = 'c1'")
            assert _backlog(conn) == _live_backlog(conn)
        downgrade(url, "0007")
        assert "task_backlog" not in _tables(url)


def _backlog(conn: psycopg.Connection) -> dict[tuple[str, str], int]:
    rows = conn.execute(
        "SELECT service, client_id, sum(pending) FROM task_backlog"
        " GROUP BY 1, 2 HAVING sum(pending) <> 0"
    )
    return {(r[0], r[1]): int(r[2]) for r in rows}


def _live_backlog(conn: psycopg.Connection) -> dict[tuple[str, str], int]:
    rows = conn.execute(
        "SELECT service, client_id, count(*) FROM tasks WHERE status = 'PENDING' GROUP BY 1, 2"
    )
    return {(r[0], r[1]): int(r[2]) for r in rows}


@pytest.mark.timeout(60)
def test_every_move_of_a_queue_name_is_recorded(database_url: str) -> None:
    """0011: a move records the name left, by whatever statement makes it; moving back
    forgets it, and a service removed takes its records with it."""
    with scratch_database(database_url) as url:
        with psycopg.connect(libpq(url), autocommit=True) as conn:

            def moved() -> list[tuple[str, str]]:
                rows = conn.execute("SELECT queue_name, service FROM moved_queues ORDER BY 1")
                return [(r[0], r[1]) for r in rows]

            conn.execute("INSERT INTO services (name, queue_name) VALUES ('s', 'a'), ('t', 't')")
            conn.execute("UPDATE services SET capacity = 3")  # not a move
            assert moved() == []
            conn.execute("UPDATE services SET queue_name = 'b' WHERE name = 's'")
            conn.execute("UPDATE services SET queue_name = 'c' WHERE name = 's'")
            assert moved() == [("a", "s"), ("b", "s")]
            conn.execute("UPDATE services SET queue_name = 'a' WHERE name = 's'")
            assert moved() == [("b", "s"), ("c", "s")]
            conn.execute("UPDATE services SET queue_name = 'x' WHERE name = 't'")
            conn.execute("DELETE FROM services WHERE name = 's'")
            assert moved() == [("t", "t")]


def test_a_password_percent_encoded_in_the_url_migrates(database_url: str) -> None:
    """Found by a review: a password with `@` or `/` is percent-encoded in the URL
    (`p%40ss`), and Alembic's configuration read `%` as its interpolation syntax:
    `conveyor db upgrade` failed ("invalid interpolation syntax"), so the migration Job
    never made the schema. (The server here trusts its clients: the password is only
    read.)"""
    with scratch_database(database_url, migrate=False) as url:
        user, _, rest = url.partition("@")
        encoded = f"{user}:p%40ss%2Fw%25rd@{rest}"
        upgrade(encoded)
        with psycopg.connect(libpq(url)) as conn:
            found = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = 'tasks'"
            ).fetchone()
        assert found == (1,)


def test_upgrades_at_once_all_succeed(database_url: str) -> None:
    """Found by a sweep: `conveyor db upgrade`s at once (two migration Jobs, a rollout and
    a retry) raced, and all but one failed with a traceback (`DuplicateDatabase`, or a
    unique violation in the catalogue), failing its Job. They take turns now."""
    with scratch_database(database_url, migrate=False) as url:
        drop_database(url)  # a database to create, as on a fresh install
        env = {**os.environ, "CONVEYOR_DATABASE_URL": url}
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "conveyor", "db", "upgrade"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        outcomes = [(run.wait(timeout=120), run.stderr.read()[-1500:]) for run in runs]
        assert [code for code, _ in outcomes] == [0, 0, 0], outcomes
        with psycopg.connect(libpq(url)) as conn:
            version = conn.execute("SELECT count(*) FROM alembic_version").fetchone()
        assert version == (1,)


@pytest.mark.timeout(90)
def test_a_backfill_leaves_the_tasks_table_usable_while_it_runs(database_url: str) -> None:
    """Found by a black-box sweep of a rolling update: every pending revision ran in one
    transaction, and 0014's backfill (an UPDATE reading the whole table) ran in the one that
    added its column, holding that ACCESS EXCLUSIVE lock until the last revision committed:
    with 2,000,000 finished tasks, the running gateways' submissions and polls waited up to
    8 s, one answered 503. Each revision commits on its own now, and the backfill runs once
    its column is committed, taking row locks only. Here the backfill is held up (a trigger on
    each row waits for a lock the test holds); meanwhile the table must answer a read."""
    with scratch_database(database_url, migrate=False) as url:
        upgrade(url, "0013")
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO tasks (task_id, client_id, service, status, request, error_message,"
                " end_date) SELECT gen_random_uuid(), 'c', 's', 'FAILURE', '{}',"
                " 'Task cancelled.', now() FROM generate_series(1, 3)"
            )
            # Each row the backfill updates waits for a lock this test holds.
            conn.execute(
                "CREATE FUNCTION held_up() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " PERFORM pg_advisory_lock(4242); PERFORM pg_advisory_unlock(4242);"
                " RETURN NEW; END $$"
            )
            conn.execute(
                "CREATE TRIGGER held_up BEFORE UPDATE ON tasks"
                " FOR EACH ROW EXECUTE FUNCTION held_up()"
            )
        holder = psycopg.connect(libpq(url), autocommit=True)
        try:
            holder.execute("SELECT pg_advisory_lock(4242)")
            migrating = threading.Thread(target=upgrade, args=(url,), daemon=True)
            migrating.start()
            with psycopg.connect(libpq(url), autocommit=True) as watcher:
                deadline = time.monotonic() + 30
                while not watcher.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory'"
                    " AND query LIKE 'UPDATE tasks SET cancelled_at%'"
                ).fetchone():
                    assert time.monotonic() < deadline, "the backfill never waited"
                    time.sleep(0.05)
                watcher.execute("SET lock_timeout = '1s'")
                assert watcher.execute("SELECT count(*) FROM tasks").fetchone() == (3,)
        finally:
            holder.execute("SELECT pg_advisory_unlock(4242)")
            holder.close()
        migrating.join(60)
        assert not migrating.is_alive()
        with psycopg.connect(libpq(url)) as conn:
            filled = conn.execute("SELECT count(cancelled_at) FROM tasks").fetchone()
            assert filled == (3,)
        _assert_full_schema(url)
