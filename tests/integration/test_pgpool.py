"""The hot path's pool (`gateway.pgpool`) against a real PostgreSQL.

Outages are simulated with a TCP proxy in front of PostgreSQL, never by stopping
the server itself.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.database_url import libpq
from gateway.pgpool import CONNECTION_ERRORS, Pool, jsonb


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[Pool]:
    """A single connection: a different backend pid means it was replaced."""
    pool = Pool(database_url, size=1)
    yield pool
    await pool.close()


async def _pid(pool: Pool) -> int:
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
        return row.pid


async def _terminate(database_url: str, *pids: int) -> None:
    async with await psycopg.AsyncConnection.connect(libpq(database_url), autocommit=True) as admin:
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])


async def test_autocommit_connections_with_namedtuple_rows(pool: Pool) -> None:
    async with pool.connection() as conn:
        assert conn.autocommit
        row = await (await conn.execute("SELECT 1 AS one, 'two' AS two")).fetchone()
    assert (row.one, row.two) == (1, "two")


async def test_jsonb_roundtrip(pool: Pool) -> None:
    value = {"a": [1, 2.5, None, True], "b": {"c": "é"}}
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT %s::jsonb AS v", [jsonb(value)])).fetchone()
        assert row.v == value
        null = await (await conn.execute("SELECT %s::jsonb AS v", [jsonb(None)])).fetchone()
        assert null.v is None


async def test_connections_are_reused(pool: Pool) -> None:
    assert await _pid(pool) == await _pid(pool)


async def test_a_connection_terminated_while_idle_is_not_handed_out(
    pool: Pool, database_url: str
) -> None:
    old = await _pid(pool)
    await _terminate(database_url, old)
    started = time.monotonic()
    assert await _pid(pool) != old
    assert time.monotonic() - started < 4


async def test_all_connections_terminated_while_idle(database_url: str) -> None:
    """As after a PostgreSQL restart: every idle connection is dead at once."""
    pool = Pool(database_url, size=3)
    try:
        async with pool.connection() as a, pool.connection() as b, pool.connection() as c:
            pids = {
                (await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()).pid
                for conn in (a, b, c)
            }
        await _terminate(database_url, *pids)
        started = time.monotonic()
        for _ in range(3):
            assert await _pid(pool) not in pids
        assert time.monotonic() - started < 1  # no backoff between dead connections
    finally:
        await pool.close()


async def test_a_connection_broken_in_use_is_not_reused(pool: Pool, database_url: str) -> None:
    with pytest.raises(psycopg.OperationalError):
        async with pool.connection() as conn:
            pid = (await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()).pid
            await _terminate(database_url, pid)
            await conn.execute("SELECT 1")
    assert await _pid(pool) != pid


async def test_a_connection_given_back_in_a_transaction_is_closed_not_committed(
    pool: Pool,
) -> None:
    table = f"pgpool_{uuid.uuid4().hex[:8]}"
    async with pool.connection() as conn:
        await conn.execute(f"CREATE TABLE {table} (x int)")
    async with pool.connection() as conn:
        pid = (await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()).pid
        await conn.execute("BEGIN")
        await conn.execute(f"INSERT INTO {table} VALUES (1)")
    async with pool.connection() as conn:
        row = await (
            await conn.execute(f"SELECT count(*) AS n, pg_backend_pid() AS pid FROM {table}")
        ).fetchone()
        await conn.execute(f"DROP TABLE {table}")
    assert row.n == 0
    assert row.pid != pid


async def test_a_connection_left_by_an_error_inside_a_transaction_is_not_reused(
    pool: Pool,
) -> None:
    with pytest.raises(RuntimeError):
        async with pool.connection() as conn:
            pid = (await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()).pid
            await conn.execute("BEGIN")
            raise RuntimeError("boom")
    assert await _pid(pool) != pid


async def _table(pool: Pool) -> str:
    table = f"pgpool_{uuid.uuid4().hex[:8]}"
    async with pool.connection() as conn:
        await conn.execute(f"CREATE TABLE {table} (x int PRIMARY KEY)")
    return table


async def _rows(pool: Pool, table: str) -> list[int]:
    async with pool.connection() as conn:
        rows = await (await conn.execute(f"SELECT x FROM {table} ORDER BY x")).fetchall()
    return [row.x for row in rows]


async def test_a_batch_commits_together_in_one_round_trip(pool: Pool) -> None:
    """libpq's trace of the batch's protocol messages: one Sync, so one ReadyForQuery.
    psycopg's `conn.transaction()` inside a pipeline made it four."""
    table = await _table(pool)
    with tempfile.TemporaryFile() as trace:
        async with pool.batch() as conn:
            conn.pgconn.trace(trace.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            inserted = await conn.execute(f"INSERT INTO {table} VALUES (1), (2) RETURNING x")
            counted = await conn.execute(f"SELECT count(*) AS n FROM {table}")
        conn.pgconn.untrace()
        trace.seek(0)
        messages = trace.read().decode()
    assert [row.x for row in await inserted.fetchall()] == [1, 2]
    assert (await counted.fetchone()).n == 2  # the statements saw each other's work
    assert messages.count("ReadyForQuery") == 1, messages
    assert await _rows(pool, table) == [1, 2]
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert await _pid(pool) == conn.info.backend_pid  # the connection was kept


async def test_a_statement_refused_in_a_batch_commits_none_of_it(pool: Pool) -> None:
    table = await _table(pool)
    with pytest.raises(psycopg.errors.UniqueViolation):
        async with pool.batch() as conn:
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
            await conn.execute(f"INSERT INTO {table} VALUES (2)")
    assert await _rows(pool, table) == []
    async with pool.batch() as conn:  # the pool serves a clean connection after it
        await conn.execute(f"INSERT INTO {table} VALUES (3)")
    assert await _rows(pool, table) == [3]


async def test_an_exception_inside_a_batch_commits_none_of_it(pool: Pool) -> None:
    """Even statements the server has already run: COMMIT is never sent."""
    table = await _table(pool)
    with pytest.raises(RuntimeError):
        async with pool.batch() as conn:
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
            raise RuntimeError("boom")
    assert await _rows(pool, table) == []

    async def cancelled() -> None:
        async with pool.batch() as conn:
            await conn.execute(f"INSERT INTO {table} VALUES (2)")
            await asyncio.sleep(30)

    task = asyncio.create_task(cancelled())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _rows(pool, table) == []


async def test_cancelled_mid_statement(pool: Pool) -> None:
    pid: list[int] = []

    async def slow() -> None:
        async with pool.connection() as conn:
            row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
            pid.append(row.pid)
            await conn.execute("SELECT pg_sleep(10)")

    task = asyncio.create_task(slow())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with pool.connection() as conn:  # healthy, whichever connection it is
        row = await (await conn.execute("SELECT 1 AS one")).fetchone()
    assert row.one == 1


async def test_a_batch_given_up_on_commits_nothing_afterwards(database_url: str) -> None:
    """Found by a sweep: a submission whose insert waited on a lock (an operator's LOCK TABLE)
    past CONVEYOR_DB_TIMEOUT was answered 503 503001, yet committed once the lock was
    released: shutting the socket down stops the client, not the server, which had the
    batch's COMMIT queued already. So the retry the 503 asks for made a second task. The
    server now gives a statement up before the pool gives the connection up."""
    pool = Pool(database_url, size=1, use_timeout=2)
    try:
        table = await _table(pool)
        async with await psycopg.AsyncConnection.connect(libpq(database_url)) as locker:
            await locker.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(CONNECTION_ERRORS):
                async with pool.batch() as conn:
                    await conn.execute(f"INSERT INTO {table} VALUES (1)")
            assert time.monotonic() - started < 2.5
            await locker.rollback()  # the lock is released
        await asyncio.sleep(1.0)
        assert await _rows(pool, table) == []
    finally:
        await pool.close()


async def test_a_transaction_left_open_by_a_frozen_process_ends_within_the_timeout(
    database_url: str,
) -> None:
    """Found by a sweep: a gateway replica frozen (SIGSTOP) in the middle of a transaction
    kept the service's writer lock for as long as it was frozen, and every replica's
    submissions to that service waited on it: its own deadline cannot fire in a process that
    does not run. The server now ends a transaction left idle longer than a lending may last."""
    pool = Pool(database_url, size=1, use_timeout=2)
    key = uuid.uuid4().int % 2**62
    waited: list[float] = []

    def other_replica() -> None:
        with psycopg.connect(libpq(database_url), autocommit=True) as other:
            started = time.monotonic()
            other.execute("SELECT pg_advisory_lock(%s)", [key])
            waited.append(time.monotonic() - started)

    try:
        async with pool.connection() as conn:
            await conn.execute("BEGIN")
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", [key])
            waiter = threading.Thread(target=other_replica)
            waiter.start()
            time.sleep(4.5)  # noqa: ASYNC251 -- the process frozen: its event loop does not run either
            with pytest.raises(CONNECTION_ERRORS):  # thawed: its transaction is gone
                await conn.execute("SELECT 1")
        waiter.join(timeout=10)
        assert waited and waited[0] < 3.8, waited  # 2 s: the server ended the transaction
    finally:
        await pool.close()


async def test_close_a_pool_never_used(database_url: str) -> None:
    await Pool(database_url, size=4).close()


async def test_checkout_after_close_fails(database_url: str) -> None:
    pool = Pool(database_url, size=2)
    await _pid(pool)
    await pool.close()
    with pytest.raises(psycopg.OperationalError):
        await _pid(pool)


async def test_unreachable_database_fails_fast() -> None:
    pool = Pool("postgresql+psycopg://postgres@127.0.0.1:1/x", size=2, connect_timeout=2)
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        await _pid(pool)
    assert time.monotonic() - started < 4
    await pool.close()


async def test_waiting_for_a_free_connection_is_bounded(database_url: str) -> None:
    pool = Pool(database_url, size=1, connect_timeout=1)
    try:
        async with pool.connection():
            started = time.monotonic()
            with pytest.raises(psycopg.OperationalError):
                await _pid(pool)
            assert time.monotonic() - started < 3
        await _pid(pool)
    finally:
        await pool.close()


class _Proxy:
    """A TCP proxy to PostgreSQL that can go down (cutting every link) and come back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def test_recovers_after_an_outage(database_url: str) -> None:
    params = conninfo_to_dict(libpq(database_url))
    proxy = _Proxy(str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
    await proxy.start()
    url = make_conninfo(libpq(database_url), host="127.0.0.1", port=proxy.port)
    pool = Pool(url, size=2, connect_timeout=2)
    try:
        before = await _pid(pool)

        await proxy.stop()  # every connection cut, new ones refused
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            await _pid(pool)
        assert time.monotonic() - started < 4
        await asyncio.sleep(6)  # long enough for the pool's reconnection attempts to give up
        with pytest.raises(psycopg.OperationalError):
            await _pid(pool)

        await proxy.start()
        started = time.monotonic()
        after = await _pid(pool)
        assert after != before
        assert time.monotonic() - started < 4
    finally:
        await pool.close()
        await proxy.stop()
