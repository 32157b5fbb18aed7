"""What an operator is told when a command meets a database it cannot use.

An unreachable server, a database not migrated yet, a revision Alembic does not know: these
are situations, not bugs, so each is one line on stderr and exit 1 instead of a traceback of
50 lines. Anything else still ends in its traceback: that one is ours to fix.
"""

from __future__ import annotations


def explain(exc: BaseException) -> str | None:
    """One line for an operator's situation; None for anything else. Imports lazily: a
    dispatcher-only image has neither psycopg nor alembic."""
    try:
        import psycopg
        from alembic.util import CommandError

        from gateway.migrate import SchemaOutOfPath
        from gateway.schema import UPGRADE
    except ModuleNotFoundError:
        return None
    exc = getattr(exc, "orig", None) or exc  # what SQLAlchemy wrapped (a migration's)
    if isinstance(exc, SchemaOutOfPath):
        return str(exc)
    if isinstance(exc, psycopg.errors.InvalidSchemaName):
        return (
            f"the session's search_path names no schema to create Conveyor's tables in: set it"
            f" (ALTER ROLE … SET search_path) to one that exists, then {UPGRADE}"
        )
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return (
            "a long transaction holds a lock on a table the migration changes (each try waits"
            " 5 s for it): end that transaction, or run the command again later"
        )
    if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn):
        return f"the database lacks Conveyor's schema, or part of it: {UPGRADE}"
    if isinstance(exc, psycopg.OperationalError):
        return f"cannot use the database: {_first_line(exc)}"
    if isinstance(exc, CommandError):
        return (
            f"{_first_line(exc)} (a revision this version does not know: mistyped, or"
            " from a newer version of Conveyor)"
            if "Can't locate revision" in str(exc)
            else _first_line(exc)
        )
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else exc.__class__.__name__
