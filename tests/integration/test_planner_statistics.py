"""Plans cached on an empty `tasks` must not scan the table once it has grown.

On real PostgreSQL, in a database of the test's own, with autovacuum off for its tables (as on
a server with `autovacuum = off`): the pooled connection prepares the results path's and the
publish path's statements while `tasks` is empty, then the table grows. What a statement read
is PostgreSQL's own count for the running transaction (`pg_stat_xact_user_tables`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from psycopg.types.json import Jsonb

from gateway import lifecycle
from gateway.outbox import _MARK_PUBLISHED
from gateway.pgpool import Pool, connect
from gateway.planner_statistics import refresh
from tests.support.amqp import scratch_database
from tests.support.gateway import GatewayProcess, gateway_env
from tests.support.metrics import value
from tests.support.processes import Processes

ROWS = 20_000


def _finishes(count: int) -> lifecycle.Finishes:
    now = datetime.now(UTC)
    params = {
        "status": "SUCCESS",
        "time": now,
        "attempt": "attempt-1",
        "response": Jsonb({}),
        "error_message": None,
        "started": now,
        "host": "h",
        "by_worker": True,
        "queue": None,
    }
    return lifecycle.Finishes(
        [
            lifecycle.Transition(
                lifecycle._FINISH_MANY,
                {**params, "task_id": uuid.uuid4()},
                lifecycle.Applied.FINISHED,
            )
            for _ in range(count)
        ]
    )


async def _rows_scanned(pool: Pool) -> int:
    """One results batch and one publish batch; the rows of `tasks` they read sequentially.
    (The backend's counts not yet reported, read before and after, in the same transaction.)"""
    finishes = _finishes(3)
    read = "SELECT seq_tup_read AS n FROM pg_stat_xact_user_tables WHERE relname = 'tasks'"
    async with pool.batch() as conn:
        before = await conn.execute(read)
        await conn.execute(finishes.sql, finishes.params)
        await conn.execute(_MARK_PUBLISHED, {"ids": [1, 2, 3]})
        after = await conn.execute(read)
    return int((await after.fetchone()).n) - int((await before.fetchone()).n)


async def _grow(url: str, writer: Any, rows: int) -> None:
    """Finished tasks written behind the gateway's back, waited for until the writing backend
    has reported them (told to at its next idle moment)."""
    await writer.execute(
        """INSERT INTO tasks (task_id, client_id, service, request, status, publish_at)
           SELECT gen_random_uuid(), 'c1', 'svc', '{}'::jsonb, 'SUCCESS', NULL
             FROM generate_series(1, %(rows)s)""",
        {"rows": rows},
    )
    await writer.execute("SELECT pg_stat_force_next_flush()")
    async with await connect(url) as conn:
        for _ in range(100):
            row = await (
                await conn.execute(
                    "SELECT n_mod_since_analyze AS n FROM pg_stat_user_tables"
                    " WHERE relname = 'tasks'"
                )
            ).fetchone()
            if row.n >= rows:
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the inserted rows never showed in pg_stat_user_tables")


async def _grown_after_plans(url: str) -> None:
    async with await connect(url) as admin:
        for table in ("tasks", "task_attempts"):
            await admin.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        pool = Pool(url, size=1)
        try:
            for _ in range(15):  # past psycopg's and PostgreSQL's thresholds: generic plans
                await _rows_scanned(pool)
            await _grow(url, admin, ROWS)
            # The bug: every batch reads the whole table, twice.
            assert await _rows_scanned(pool) >= ROWS

            async with pool.connection() as conn:
                assert "tasks" in await refresh(conn)
            assert await _rows_scanned(pool) == 0
            async with pool.connection() as conn:
                assert await refresh(conn) == []  # fresh now: nothing more to do
        finally:
            await pool.close()


@pytest.mark.timeout(120)
def test_plans_made_on_an_empty_table_are_made_again_once_it_grew(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_grown_after_plans(url))


async def _one_at_a_time(url: str) -> None:
    async with await connect(url) as admin, await connect(url) as other:
        await admin.execute("ALTER TABLE tasks SET (autovacuum_enabled = false)")
        await _grow(url, admin, 500)
        async with other.transaction():  # another replica analyzing
            await other.execute("SELECT pg_advisory_xact_lock(hashtext('conveyor.analyze'))")
            assert await asyncio.wait_for(refresh(admin), timeout=5) == []
        assert "tasks" in await refresh(admin)

        # A plain ANALYZE or VACUUM in progress elsewhere: the pass gives up after its lock
        # timeout instead of waiting behind it.
        async with other.transaction():
            await other.execute("LOCK TABLE tasks IN SHARE UPDATE EXCLUSIVE MODE")
            await _grow(url, admin, 500)
            with pytest.raises(Exception, match="lock timeout"):
                await asyncio.wait_for(refresh(admin), timeout=5)
        assert "tasks" in await refresh(admin)


@pytest.mark.timeout(60)
def test_one_replica_analyzes_and_none_waits(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_one_at_a_time(url))


@pytest.mark.timeout(90)
def test_the_gateway_analyzes_what_autovacuum_leaves_alone(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """The loop runs in a real gateway: rows written behind its back get their ANALYZE."""
    with scratch_database(database_url) as url:

        async def grow() -> None:
            async with await connect(url) as admin:
                await admin.execute("ALTER TABLE tasks SET (autovacuum_enabled = false)")
                await _grow(url, admin, 500)

        async def analyzed() -> bool:
            async with await connect(url) as conn:
                row = await (
                    await conn.execute(
                        "SELECT last_analyze FROM pg_stat_user_tables WHERE relname = 'tasks'"
                    )
                ).fetchone()
            return row.last_analyze is not None

        # Grown before the gateway starts: a running loop could analyze the rows before `_grow`
        # saw them counted, and `_grow` would wait for a count the ANALYZE had already reset.
        asyncio.run(grow())
        env = gateway_env(url, amqp_url, CONVEYOR_ANALYZE_INTERVAL="0.2")
        gateway = GatewayProcess(procs, env, "gateway-statistics")
        deadline = time.monotonic() + 30
        while not asyncio.run(analyzed()):
            assert time.monotonic() < deadline, "the gateway never analyzed tasks"
            time.sleep(0.2)

        def counted() -> float:
            metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
            return value(metrics, "conveyor_gateway_tables_analyzed_total", table="tasks")

        # ANALYZE shows in pg_stat_user_tables as it ends; the gateway counts it after its
        # transaction commits (a WAL flush, slow on a slow disk).
        deadline = time.monotonic() + 15
        while not counted():
            assert time.monotonic() < deadline, "the ANALYZE was never counted"
            time.sleep(0.2)
        assert counted() == 1
