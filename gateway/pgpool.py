"""Raw psycopg connections for the API's hot path (submit and poll).

Measured on the benchmark VM, SQLAlchemy's async layer costs about 150 µs of
CPU per statement and as much per pool checkout, on top of psycopg's own
~50 µs; a submission made two checkouts, a pre-ping, BEGIN/COMMIT and
ROLLBACK around two statements. The API therefore talks to PostgreSQL through
this small pool of plain `psycopg.AsyncConnection`s in autocommit mode:

* a single statement is its own transaction, so the insert of a task and its
  outbox entry (one statement) stays atomic without BEGIN/COMMIT;
* multi-statement work (capacity, idempotency) uses `conn.transaction()`;
* psycopg prepares repeated statements on the server by itself.

Dead connections are weeded out as SQLAlchemy's `pool_pre_ping` did, without
its round trip on every checkout: an idle connection has nothing to read, so
only one whose socket is readable (a server that terminates a session sends a
FATAL message and closes it) or that has been idle for longer than
`ping_after` is pinged before use. A connection that fails with a connection
error is closed, and every idle connection opened before that failure is
discarded too (after a PostgreSQL restart they are all dead). The background
loops keep using SQLAlchemy.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import psycopg
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads

CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


def dsn(database_url: str) -> str:
    """The SQLAlchemy URL (`postgresql+psycopg://`) as libpq reads it."""
    return database_url.replace("postgresql+psycopg://", "postgresql://", 1)


def jsonb(value: Any) -> Jsonb | None:
    """A JSON parameter for a jsonb column, encoded by orjson; None stays SQL NULL."""
    return None if value is None else Jsonb(value, dumps=orjson.dumps)


class Pool:
    def __init__(
        self, database_url: str, size: int, ping_after: float = 2.0, connect_timeout: int = 5
    ) -> None:
        self.url = dsn(database_url)
        self.ping_after = ping_after
        self.connect_timeout = connect_timeout
        self._slots = asyncio.Semaphore(size)
        self._idle: list[tuple[psycopg.AsyncConnection[Any], float, int]] = []  # LIFO
        self._generation = 0
        self._closed = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in autocommit mode, returned to the pool afterwards."""
        async with self._slots:
            conn = await self._take()
            try:
                yield conn
            except BaseException as exc:
                await self._give_back(conn, exc)
                raise
            await self._give_back(conn, None)

    async def _take(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn, since, generation = self._idle.pop()
            if conn.closed or generation != self._generation:
                await _close(conn)
                continue
            suspect = _readable(conn) or time.monotonic() - since > self.ping_after
            if suspect and not await _alive(conn):
                self._generation += 1  # the server went away: its siblings are dead as well
                await _close(conn)
                continue
            return conn
        return await self._open()

    async def _open(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(
            self.url,
            autocommit=True,
            connect_timeout=self.connect_timeout,
            row_factory=namedtuple_row,
        )
        set_json_dumps(orjson.dumps, conn)
        set_json_loads(orjson.loads, conn)
        return conn

    async def _give_back(
        self, conn: psycopg.AsyncConnection[Any], error: BaseException | None
    ) -> None:
        broken = conn.closed or conn.broken or isinstance(error, CONNECTION_ERRORS)
        if isinstance(error, CONNECTION_ERRORS):
            self._generation += 1  # its siblings are likely dead as well
        if not broken and conn.info.transaction_status != TransactionStatus.IDLE:
            broken = True  # interrupted mid-statement (e.g. cancelled): do not reuse
        if broken or self._closed:
            await _close(conn)
            return
        self._idle.append((conn, time.monotonic(), self._generation))

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        await asyncio.gather(*(_close(conn) for conn, _, _ in idle))


def _readable(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Something arrived on an idle connection: a notice, or the server's goodbye."""
    try:
        poller = select.poll()  # not select.select(): no FD_SETSIZE limit
        poller.register(conn.pgconn.socket, select.POLLIN)
        events = poller.poll(0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(events) or conn.pgconn.status != ConnStatus.OK


async def _alive(conn: psycopg.AsyncConnection[Any]) -> bool:
    try:
        await conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.close()
    except Exception:  # closing a dead connection may complain; it is gone either way
        pass
