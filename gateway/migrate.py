"""Schema management: Alembic, driven from code so that `conveyor db upgrade`
needs no alembic.ini, and creates the database itself on a fresh machine."""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
from alembic import command
from alembic.config import Config
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from conveyor.settings import normalize_database_url
from gateway.database_url import database_name, libpq, with_database

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"

log = logging.getLogger("conveyor.gateway.migrate")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # The options are a ConfigParser's, where `%` is interpolation: a password percent-encoded
    # in the URL (`p%40ss`) is written `%%` to be read back as it is.
    url = normalize_database_url(database_url).replace("%", "%%")
    config.set_main_option("sqlalchemy.url", url)
    return config


def ensure_database(database_url: str) -> bool:
    """Creates the database named in the URL if it does not exist; True if created.

    Through the server's `postgres` database, on the same host list and options
    (`target_session_attrs=read-write` finds the primary).
    """
    name = database_name(database_url)
    with psycopg.connect(libpq(with_database(database_url, "postgres")), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists:
            return False
        try:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
            return False  # another upgrade made it meanwhile
        return True


def drop_database(database_url: str) -> None:
    """Drops the database named in the URL, sessions and all (test and bench runs)."""
    name = database_name(database_url)
    with psycopg.connect(libpq(with_database(database_url, "postgres")), autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


# Held by whoever changes the schema: two upgrades at once (two migration Jobs) take turns,
# where they raced and all but one failed; the next one finds the work done.
_SCHEMA_LOCK = "SELECT pg_advisory_lock(hashtext('conveyor.schema'))"


# The schemas holding Conveyor's tables that the session's search_path does not name: an
# operator's `ALTER ROLE … SET search_path` left them out, and an upgrade would have made a
# second, empty catalog in the schema named instead (found by a sweep).
OUT_OF_PATH = (
    "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE c.relname = 'alembic_version' AND c.relkind = 'r'"
    " AND to_regclass(format('%I.tasks', n.nspname)) IS NOT NULL"
    " AND n.nspname <> ALL (current_schemas(false)) AND to_regclass('alembic_version') IS NULL"
    " ORDER BY 1"
)


class SchemaOutOfPath(Exception):
    """Conveyor's tables are in a schema the session's search_path does not name."""

    def __init__(self, schemas: list[str], search_path: str) -> None:
        super().__init__(
            f"Conveyor's tables are in schema {', '.join(schemas)}, which the session's"
            f" search_path ({search_path}) does not name: add it (ALTER ROLE … SET search_path),"
            " rather than migrate again"
        )


def upgrade(database_url: str, revision: str = "head") -> None:
    with psycopg.connect(libpq(database_url), autocommit=True) as holder:
        holder.execute(_SCHEMA_LOCK)  # released when `holder` closes
        if schemas := [row[0] for row in holder.execute(OUT_OF_PATH)]:
            search_path = holder.execute("SHOW search_path").fetchone()
            raise SchemaOutOfPath(schemas, search_path[0] if search_path else "")
        for attempt in _while_locked_out():
            with attempt:
                command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    with psycopg.connect(libpq(database_url), autocommit=True) as holder:
        holder.execute(_SCHEMA_LOCK)
        for attempt in _while_locked_out():
            with attempt:
                command.downgrade(alembic_config(database_url), revision)


# A revision waits for a table's lock at most `migrations/env.py`'s LOCK_TIMEOUT: a long
# transaction holding it would otherwise queue every statement on that table behind the
# revision. Each revision commits on its own, so a try again resumes where the last stopped.
LOCKED_OUT_ATTEMPTS = 6


def _while_locked_out() -> Retrying:
    return Retrying(
        retry=retry_if_exception(_locked_out),
        stop=stop_after_attempt(LOCKED_OUT_ATTEMPTS),
        wait=wait_exponential(multiplier=1, max=10),
        before_sleep=_say_locked_out,
        reraise=True,
    )


def _locked_out(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "orig", exc), psycopg.errors.LockNotAvailable)


def _say_locked_out(state: RetryCallState) -> None:
    log.warning(
        "a migration gave up waiting for a table's lock (a long transaction holds it);"
        " trying again",
        extra={"attempt": state.attempt_number, "seconds": round(state.upcoming_sleep, 1)},
    )
