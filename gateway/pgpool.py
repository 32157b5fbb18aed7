"""The gateway's one way to PostgreSQL: raw psycopg connections in autocommit mode.

One `psycopg_pool.AsyncConnectionPool` per process serves the API and every loop (a single
statement is its own transaction; statements that commit together on the hot path go through
`Pool.batch()`, one round trip, and elsewhere through `conn.transaction()`); commands
open one connection with `connect()`. Only three things are ours: a liveness check that
pings only a connection that looks dead (readable while idle, or idle for long), instead of a
round trip per checkout; a connection given back mid-transaction is closed, not reused; and
every connection has the same session settings (`set_up`).
`reconnect_timeout` is short so that after an outage the next checkout retries at once
rather than waiting out the pool's own backoff.

A connection is lent for at most `use_timeout` seconds (CONVEYOR_DB_TIMEOUT). A server
that is frozen, or behind a partition that drops packets silently, never answers and never
closes: its statements waited without end (a submission hung for as long as the freeze).
At the deadline the connection's socket is shut down, so whatever waits on it fails at once
as a lost connection, which the API answers 503 503001 and a loop retries. Shut down, not
cancelled: a cancelled statement would still have its pipeline or transaction wound up by a
round trip to the server that does not answer.

That stops the client, not a server that does answer, only slowly: a statement waiting on a
lock went on, and the COMMIT queued behind it in a batch committed a submission answered 503
(whose retry then made a second task). So the server gives up first: each statement of a lent
connection ends at `server_timeout` (a little before the pool's deadline), as does a
transaction left idle longer than a lending may last, which a process frozen mid-transaction
(SIGSTOP) would otherwise hold, with its locks, for as long as it is frozen. Two cases remain
where a 503 may hide a commit, which an Idempotency-Key makes safe to retry: a server frozen
when a request reaches it (committed at the thaw), and a COMMIT waiting for a synchronous
standby that does not answer (written on the primary already: cut, it stays committed).
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from psycopg_pool import AsyncConnectionPool

from conveyor import strict_json
from gateway.database_url import libpq

# A connection the server ended for a transaction left idle too long (a process frozen in
# it, see above) is lost like any other, though PostgreSQL classes the error as internal.
# A database that takes no writes (a failover target still a standby, a primary demoted under
# its connections, `default_transaction_read_only`) is away too, not a refusal of what was
# written: results were set aside and their tasks failed, loops crashed (found by a sweep).
CONNECTION_ERRORS = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    psycopg.errors.IdleInTransactionSessionTimeout,
    psycopg.errors.ReadOnlySqlTransaction,
)
# A statement refused for want of room on the server (SQLSTATE 53000, 53100, 53200; psycopg
# gives each its own class), and how long one keeps readiness at 503 (`Pool.short_of_room`).
OUT_OF_ROOM = (
    psycopg.errors.InsufficientResources,
    psycopg.errors.DiskFull,
    psycopg.errors.OutOfMemory,
)
REFUSED_FOR = 5.0
# What the loops that touch many rows at once may take (ANALYZE of a large table, the reaper
# giving old rows their expiry), where a request waits CONVEYOR_DB_TIMEOUT at most.
MAINTENANCE_TIMEOUT = 600.0


def jsonb(value: Any) -> Jsonb | None:
    """A JSON parameter for a jsonb column (conveyor.strict_json: orjson's speed, every
    integer's digits); None stays SQL NULL."""
    return None if value is None else Jsonb(value, dumps=strict_json.dumps)


async def connect(database_url: str, connect_timeout: int = 5) -> psycopg.AsyncConnection[Any]:
    """One connection outside the pool, for a command's lifetime (admin, purge): autocommit,
    rows as named tuples, JSON through conveyor.strict_json, like the pool's."""
    conn = await psycopg.AsyncConnection.connect(
        libpq(database_url),
        autocommit=True,
        row_factory=namedtuple_row,
        connect_timeout=connect_timeout,
    )
    await set_up(conn)
    return conn


# What a session's reading depends on, whatever an operator gave the database or the role
# (`ALTER ROLE … SET`, found by a sweep): psycopg reads dates in ISO only (`SQL, DMY` made every
# request 500), and conveyor.strict_json reads JSON in UTF-8 (a LATIN1 client_encoding made a
# stored body unreadable: the outbox relay stopped at its row, with every task behind it); its
# transactions are written for READ COMMITTED (`serializable` refused two thirds of concurrent
# submissions as serialization failures, answered 503). And no JIT: every statement here reads
# a few rows through an index, but an estimate over a big table woke the JIT, whose compiling
# cost far more than the statement (the reaper's pass at a million PENDING rows: 0.2-0.3 s of
# JIT for a scan of three pages).
_SESSION = (
    "SELECT set_config('jit', 'off', false) AS jit,"
    " set_config('DateStyle', 'ISO, MDY', false) AS dates,"
    " set_config('IntervalStyle', 'postgres', false) AS intervals,"
    " set_config('client_encoding', 'UTF8', false) AS encoding,"
    " set_config('default_transaction_isolation', 'read committed', false) AS isolation"
)


async def set_up(conn: psycopg.AsyncConnection[Any]) -> None:
    """JSON through conveyor.strict_json, and the session's settings (_SESSION)."""
    set_json_dumps(strict_json.dumps, conn)
    set_json_loads(strict_json.loads, conn)
    await conn.execute(_SESSION)


async def commits(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a write commits now, for readiness: a read needs no synchronous standby, and
    with one away /readyz said 200 while every submission waited DB_TIMEOUT for a 503. The
    `setval` writes WAL in a transaction of its own (migration 0017), whose COMMIT waits for
    the standby like a submission's; the caller's timeout cuts it (psycopg then cancels it,
    and the connection stays usable). A role without the right to write it cannot tell: a
    read answered is taken for an answer, as before."""
    try:
        await conn.execute("SELECT setval('readiness_writes', 1)")
    except psycopg.errors.InsufficientPrivilege:
        return True
    except psycopg.Error:  # a read-only server (a standby not promoted yet), the schema older
        return False
    return True


class Pool:
    def __init__(
        self,
        database_url: str,
        size: int,
        ping_after: float = 2.0,
        connect_timeout: int = 5,
        use_timeout: float = 10.0,
    ) -> None:
        self.url = libpq(database_url)
        self.ping_after = ping_after
        self.connect_timeout = connect_timeout
        self.use_timeout = use_timeout
        self.size = size  # connections at most: what shares of the pool are counted in
        self._limits = _limits(use_timeout)
        # When the server last refused a statement for want of room (disk full, out of memory).
        self.refused_at: float | None = None
        # When each connection was last given back (or opened): the idle-time criterion.
        self._since: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        # Built here, synchronously, but opened by the first checkout (`open=False`):
        # opening starts worker tasks, which needs the running loop of the caller.
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            self.url,
            open=False,
            min_size=min(2, size),
            max_size=size,
            kwargs={
                "autocommit": True,
                "row_factory": namedtuple_row,
                "connect_timeout": connect_timeout,
            },
            configure=self._configure,
            check=self._check,
            timeout=connect_timeout,
            reconnect_timeout=max(connect_timeout, 1),
            name="gateway-hot-path",
        )

    @asynccontextmanager
    async def connection(
        self, use_timeout: float | None = None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in autocommit mode, returned to the pool afterwards; severed if it is
        still lent after `use_timeout` (the pool's by default: a long maintenance statement
        may ask for more)."""
        if self._pool.closed:  # not opened yet (open() is idempotent; after close() it raises)
            await self._pool.open()
        conn = await self._pool.getconn()
        seconds = self.use_timeout if use_timeout is None else use_timeout
        deadline = asyncio.get_running_loop().call_later(seconds, _sever, conn)
        longer = seconds != self.use_timeout
        read_only = False
        try:
            if longer:  # a maintenance statement: the server waits as long for it
                await conn.execute(_LIMITS, _limits(seconds))
            yield conn
            if longer:
                await conn.execute(_LIMITS, self._limits)
        except psycopg.errors.ReadOnlySqlTransaction:
            # a standby now, or read-only: the next connection finds the primary
            # (`target_session_attrs=read-write`), this one and its siblings never would
            read_only = True
            raise
        except OUT_OF_ROOM:
            self.refused_at = time.monotonic()  # readiness: see `short_of_room`
            raise
        finally:
            deadline.cancel()
            lost = conn.broken or read_only
            if lost or conn.info.transaction_status != TransactionStatus.IDLE:
                await _close(conn)  # broken, or interrupted mid-statement or transaction
            self._since[conn] = time.monotonic()
            await self._pool.putconn(conn)  # a closed connection is replaced by the pool
            if lost:
                await self._drain()  # its siblings are likely dead as well

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A transaction that leases rows (the relay's and the notifier's claims), committed
        once its rows were read: a claim the server runs only after the gateway gave it up
        (sent as the server froze, run at the thaw) is rolled back. Its commit waits for no
        synchronous standby: frozen, it held each claim's commit, visible on the primary all
        the same, so rows due meanwhile stayed leased 30 s by nobody (found by sweeps). A lease
        lost in a failover only means the rows are claimed again."""
        async with self.connection() as conn, conn.transaction():
            await conn.execute("SET LOCAL synchronous_commit = local")
            yield conn

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection whose statements commit together, sent in one round trip.

        BEGIN, the block's statements and COMMIT are queued in one pipeline segment and go
        with its single Sync; their results are read when the block ends. psycopg's
        `conn.transaction()` inside a pipeline syncs after BEGIN and around COMMIT: three
        more round trips, each a wake-up of both sides (bench/README.md, "One round trip per
        results batch"). An error in the block means COMMIT is never queued: the server skips
        the rest of the segment, or the segment ends with the transaction open, and
        `connection()` closes a connection given back mid-transaction, which rolls it back.
        """
        async with self.connection() as conn, conn.pipeline():
            await conn.execute("BEGIN")
            yield conn
            await conn.execute("COMMIT")

    def short_of_room(self) -> bool:
        """Whether the server refused a statement for want of room (disk full, out of memory)
        within the last `REFUSED_FOR` seconds. Readiness cannot ask for it: its write
        (`commits`) rewrites a page that exists, where a submission's insert extends its table,
        and a disk-full outage said 200 throughout while every submission was answered 503
        (found by a sweep). What the statements met is the only sign."""
        refused = self.refused_at
        return refused is not None and time.monotonic() - refused < REFUSED_FOR

    async def close(self) -> None:
        await self._pool.close()  # a no-op if never opened

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await set_up(conn)
        await conn.execute(_LIMITS, self._limits)
        self._since[conn] = time.monotonic()

    async def _check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Raises for a dead connection, which the pool then discards; pings only suspects."""
        since = self._since.get(conn, 0.0)
        if not _readable(conn) and time.monotonic() - since <= self.ping_after:
            return
        try:
            await conn.execute("SELECT 1")
        except psycopg.Error:
            await _close(conn)
            await self._drain()  # the server went away: its siblings are dead as well
            raise

    async def _drain(self) -> None:
        if not self._pool.closed:
            await self._pool.drain()


# The server's own limits for a connection lent `use_timeout` seconds: a statement, and a
# transaction idle between two statements (milliseconds, as text: set_config's). A lock is
# waited for as long as the statement may last: a `lock_timeout` an operator set on the
# database or role (10 ms) held for the life of every connection opened meanwhile, and each
# submission meeting a lock was answered 503 long after it was reset (found by a sweep).
_LIMITS = (
    "SELECT set_config('statement_timeout', %(statement)s, false) AS statement,"
    " set_config('idle_in_transaction_session_timeout', %(idle)s, false) AS idle,"
    " set_config('lock_timeout', '0', false) AS locks"
)


def server_timeout(use_timeout: float) -> float:
    """When the server ends a statement of a connection lent `use_timeout` seconds: early
    enough that its error, and the transaction's rollback, reach the client before the
    client's own deadline shuts the socket down."""
    return max(use_timeout / 2, use_timeout - 2.0)


def _limits(use_timeout: float) -> dict[str, str]:
    return {
        "statement": str(max(1, int(server_timeout(use_timeout) * 1000))),
        "idle": str(max(1, int(use_timeout * 1000))),
    }


def _readable(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Something arrived on an idle connection: a notice, or the server's goodbye."""
    try:
        poller = select.poll()  # not select.select(): no FD_SETSIZE limit
        poller.register(conn.pgconn.socket, select.POLLIN)
        events = poller.poll(0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(events) or conn.pgconn.status != ConnStatus.OK


def _sever(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shuts the connection's socket down (a duplicate of its descriptor, so libpq's own
    stays valid): a read under way ends at once, and the connection is broken."""
    try:
        duplicate = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except (OSError, psycopg.Error):
        return  # already closed
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        duplicate.close()


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.close()
    except Exception:  # closing a dead connection may complain; it is gone either way
        pass
