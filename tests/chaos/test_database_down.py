"""Found by the chaos run: a PostgreSQL restart answered 500, not 503 + Retry-After.

`database_down` built `OperationalError | pgpool.CONNECTION_ERRORS` (a type or'ed
with a tuple): a TypeError inside the error handler itself, so every request
that met the restarting database got `500 Internal error` instead of
`503 503001` (SPEC §3: "database unavailable (retry)").
"""

from __future__ import annotations

import psycopg
import pytest

from gateway.api import database_down


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.OperationalError("connection failed: the database system is shutting down"),
        psycopg.InterfaceError("the connection is closed"),
    ],
)
def test_a_database_outage_is_recognized(exc: Exception) -> None:
    assert database_down(exc)


def test_other_errors_are_not_an_outage() -> None:
    assert not database_down(ValueError("a bug"))
