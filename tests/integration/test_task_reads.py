"""What reading a task costs a caller who does not own it: nothing of the task is read.

Found by a black-box sweep: a stranger's poll, cancel or event stream of another client's task
read the whole row, its response included, before refusing it with 404002: 4 to 8 times as
long as for an unknown id with a 900 KB response, which told that the task exists and roughly
how large its response is. Observed here without a clock: PostgreSQL's count of the blocks
read from `tasks`' TOAST table (where a large response lives), on a database of the test's own.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import psycopg
import pytest

from gateway import errors
from gateway.database_url import libpq
from gateway.pgpool import Pool
from gateway.store import get_task, task_status
from tests.support.amqp import scratch_database

pytestmark = pytest.mark.timeout(60)


def _toast_blocks(url: str) -> int:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)"
            " FROM pg_statio_user_tables WHERE relname = 'tasks'"
        ).fetchone()
        return int(row[0]) if row else 0


async def test_a_strangers_read_of_a_task_reads_none_of_it(database_url: str) -> None:
    with scratch_database(database_url) as url:
        task_id = uuid.uuid4()
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO tasks (task_id, client_id, service, status, request, response,"
                " end_date) VALUES (%s, 'alice', 'svc', 'SUCCESS', '{}',"
                " jsonb_build_object('blob', %s::text), now())",
                (task_id, os.urandom(300_000).hex()),  # incompressible: out of line
            )
        pool = Pool(url, size=1)
        try:
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_stat_force_next_flush()")
            before = await asyncio.to_thread(_toast_blocks, url)
            for _ in range(5):
                for read in (get_task, task_status):
                    with pytest.raises(errors.ApiError) as refused:
                        await read(pool, "bob", "svc", task_id)
                    assert refused.value.kind is errors.TASK_NOT_FOUND
            async with pool.connection() as conn:  # this session's counts, flushed now
                await conn.execute("SELECT pg_stat_force_next_flush()")
            stranger = await asyncio.to_thread(_toast_blocks, url) - before
            owner = await get_task(pool, "alice", "svc", task_id)
            assert len(owner["response"]["blob"]) == 600_000
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_stat_force_next_flush()")
            read_by_owner = await asyncio.to_thread(_toast_blocks, url) - before - stranger
        finally:
            await pool.close()
        assert read_by_owner > 0  # the count sees a read of the response
        assert stranger == 0, f"{stranger} blocks of another client's task read"
