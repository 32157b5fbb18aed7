"""Found by the chaos run: a PostgreSQL restart answered 500, not 503 + Retry-After.

The handler that told an outage apart built `OperationalError | pgpool.CONNECTION_ERRORS`
(a type or'ed with a tuple): a TypeError inside the error handler itself, so every request
that met the restarting database got `500 Internal error` instead of `503 503001` (SPEC §3:
"database unavailable (retry)"). The connection errors now have handlers of their own, by
class, which Starlette does not re-raise (the catch-all's answers are re-raised, and uvicorn
logged each one as an error of the application).
"""

from __future__ import annotations

import asyncio

import httpx
import psycopg
import pytest

from conveyor.settings import GatewaySettings
from gateway.app import create_app


def _answer_to(exc: Exception) -> httpx.Response:
    app = create_app(GatewaySettings(), background=False)

    async def fails() -> None:
        raise exc

    app.add_api_route("/fails", fails)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/fails")

    return asyncio.run(call())


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.OperationalError("connection failed: the database system is shutting down"),
        psycopg.InterfaceError("the connection is closed"),
    ],
)
def test_a_database_outage_is_503_with_retry_after(exc: Exception) -> None:
    answer = _answer_to(exc)
    assert answer.status_code == 503
    assert answer.json()["error"]["number"] == 503001
    assert answer.headers["retry-after"] == "1"


def test_other_errors_are_500() -> None:
    answer = _answer_to(ValueError("a bug"))
    assert answer.status_code == 500
    assert answer.json()["error"]["number"] == 500001
