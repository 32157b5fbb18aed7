"""Whether the database holds the schema this code was written for.

A gateway started before `conveyor db upgrade` (a fresh machine, a migration Job still
running) answered every request 500 with a traceback, and /readyz said 200. It now says what
to do instead: the log names the command, /readyz answers 503 with `schema`, requests get
503001 until the schema is there. A schema *newer* than this code's (a rolling update
migrates first) is accepted: migrations add what older code can ignore.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import psycopg
from alembic.script import ScriptDirectory

from gateway.migrate import MIGRATIONS, OUT_OF_PATH, SchemaOutOfPath

# What a statement meets on a schema older than the code (a table or a column not made yet).
MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)
UPGRADE = "run `conveyor db upgrade`"


@cache
def _revisions() -> tuple[str, frozenset[str]]:
    """This code's head revision, and every revision it knows."""
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    assert head is not None, "migrations/ has one head"
    return head, frozenset(r.revision for r in script.walk_revisions())


async def problem(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """None if the schema is this code's or newer; else what is wrong and what to run."""
    try:
        row = await (await conn.execute("SELECT version_num FROM alembic_version")).fetchone()
    except psycopg.errors.UndefinedTable:
        schemas = [row[0] for row in await (await conn.execute(OUT_OF_PATH)).fetchall()]
        if schemas:
            search_path = await (await conn.execute("SHOW search_path")).fetchone()
            return str(SchemaOutOfPath(schemas, search_path[0] if search_path else ""))
        return f"the database has no Conveyor schema: {UPGRADE}"
    try:
        head, known = _revisions()
    except Exception:  # installed without migrations/: no revision to compare with
        return None
    current = None if row is None else row[0]
    if current == head or (current is not None and current not in known):
        return None
    return f"the database schema is at revision {current}, this gateway needs {head}: {UPGRADE}"
