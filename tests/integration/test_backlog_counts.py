"""`task_backlog` and `task_backlog_blocks` (migration 0008) count the PENDING tasks exactly,
whatever changes them, and positions and capacity checks read them instead of the backlog.

On real PostgreSQL, in a database of the test's own (one test truncates `tasks`): after every
kind of change the counts kept by the triggers must equal a live count of the rows.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from conveyor.events import EventKind, TaskEvent
from gateway import lifecycle
from gateway.database_url import libpq
from gateway.housekeeping import compact_backlog, purge
from gateway.pgpool import connect
from gateway.store import _INSERT, _PENDING_CLIENT, _PENDING_SERVICE, _POSITION, BLOCK_BITS
from tests.support.amqp import scratch_database

T0 = datetime(2026, 11, 27, 8, 0, tzinfo=UTC)

Counts = dict[tuple[str, str], int]


async def _backlog(conn: Any) -> Counts:
    rows = await conn.execute(
        "SELECT service, client_id, sum(pending) FROM task_backlog"
        " GROUP BY 1, 2 HAVING sum(pending) <> 0"
    )
    return {(r[0], r[1]): int(r[2]) for r in await rows.fetchall()}


async def _live(conn: Any) -> Counts:
    rows = await conn.execute(
        "SELECT service, client_id, count(*) FROM tasks WHERE status = 'PENDING' GROUP BY 1, 2"
    )
    return {(r[0], r[1]): int(r[2]) for r in await rows.fetchall()}


async def _blocks(conn: Any) -> dict[tuple[str, int], int]:
    rows = await conn.execute(
        "SELECT service, block, sum(pending) FROM task_backlog_blocks"
        " GROUP BY 1, 2 HAVING sum(pending) <> 0"
    )
    return {(r[0], r[1]): int(r[2]) for r in await rows.fetchall()}


async def _live_blocks(conn: Any) -> dict[tuple[str, int], int]:
    rows = await conn.execute(
        f"SELECT service, id >> {BLOCK_BITS}, count(*) FROM tasks"
        " WHERE status = 'PENDING' AND not_before IS NULL GROUP BY 1, 2"
    )
    return {(r[0], r[1]): int(r[2]) for r in await rows.fetchall()}


# The definition the counts stand in for: every PENDING task due, up to this one.
_LIVE_POSITION = """
    SELECT count(*) FROM tasks p
     WHERE p.service = %(service)s AND p.status = 'PENDING' AND p.id <= %(id)s
       AND (p.not_before IS NULL OR p.not_before <= now())
    """


async def _positions(conn: Any, service: str, row_id: int) -> tuple[int, int]:
    params = {"service": service, "id": row_id}
    counted = await (await conn.execute(_POSITION, params)).fetchone()
    live = await (await conn.execute(_LIVE_POSITION, params)).fetchone()
    return counted[0], live[0]


def _batch(client: str, count: int, not_before: datetime | None = None) -> dict[str, Any]:
    """The intake's statement's parameters, as `store.insert_many` sends them."""
    return {
        "task_ids": [uuid.uuid4() for _ in range(count)],
        "client_ids": [client] * count,
        "requests": [Jsonb({"body": {}})] * count,
        "callbacks": [None] * count,
        "keys": [None] * count,
        "not_befores": [not_before] * count,
        "delays": [None] * count,
        "traceparents": [None] * count,
        "grace": 30,
        "time_limit": 900,
        "time_to_live": 86400,
    }


async def _submit(conn: Any, service: str, client: str, count: int, **kw: Any) -> list[Any]:
    await conn.execute(  # the insert takes tasks only for a service that exists
        "INSERT INTO services (name, queue_name) VALUES (%(s)s, %(s)s) ON CONFLICT DO NOTHING",
        {"s": service},
    )
    rows = await conn.execute(_INSERT, {**_batch(client, count, **kw), "service": service})
    return sorted(await rows.fetchall(), key=lambda row: row.row_id)


def _event(kind: EventKind, task_id: uuid.UUID, second: int, **fields: Any) -> lifecycle.Transition:
    return lifecycle.transition(
        TaskEvent(
            kind=kind,
            task_id=str(task_id),
            event_id=uuid.uuid4().hex,
            time=T0 + timedelta(seconds=second),
            attempt="attempt-1",
            **fields,
        )
    )


async def _every_change(url: str) -> None:
    # Two connections: two backends, so two shards, as the intake and the results consumer.
    async with await connect(url) as intake, await connect(url) as results:

        async def check() -> None:
            assert await _backlog(results) == await _live(results)
            assert await _blocks(results) == await _live_blocks(results)

        a = await _submit(intake, "svc-a", "c1", 10)
        b = await _submit(intake, "svc-b", "c2", 4)
        later = await _submit(intake, "svc-a", "c2", 3, not_before=T0 + timedelta(days=3650))
        await check()
        assert await _backlog(results) == {
            ("svc-a", "c1"): 10,
            ("svc-b", "c2"): 4,
            ("svc-a", "c2"): 3,
        }
        # started, then ended; ended without a `started` (a short call); dead-lettered
        await lifecycle.apply(results, _event(EventKind.STARTED, a[0].task_id, 1, host="h"))
        await check()
        await lifecycle.apply(results, _event(EventKind.SUCCEEDED, a[0].task_id, 2, response=1))
        await lifecycle.apply(
            results,
            _event(EventKind.FAILED, a[1].task_id, 2, started=T0, host="h", error_message="x"),
        )
        await lifecycle.apply(results, lifecycle.failure(b[0].task_id, "Dead-lettered."))
        await check()
        # several ends in one statement, a duplicate of one of them ignored
        ends = [_event(EventKind.SUCCEEDED, r.task_id, 3, started=T0, host="h") for r in a[2:6]]
        ends.append(_event(EventKind.SUCCEEDED, a[0].task_id, 4, started=T0, host="h"))
        finishes = lifecycle.Finishes(ends)
        await results.execute(finishes.sql, finishes.params)
        await check()
        assert (await _backlog(results))[("svc-a", "c1")] == 4
        # the reaper's expiry, a plain delete, a row moved to another client, a row put
        # back to PENDING by hand, a run-later task made immediate
        await results.execute(
            "UPDATE tasks SET submission_date = now() - interval '2 days' WHERE task_id = %s",
            (a[6].task_id,),
        )
        await lifecycle.expire_pending(results, ttl=3600)
        await results.execute("DELETE FROM tasks WHERE task_id = %s", (a[7].task_id,))
        await results.execute(
            "UPDATE tasks SET client_id = 'c3' WHERE task_id = %s", (b[1].task_id,)
        )
        await results.execute(
            "UPDATE tasks SET status = 'PENDING' WHERE task_id = %s", (a[0].task_id,)
        )
        await results.execute(
            "UPDATE tasks SET not_before = NULL WHERE task_id = %s", (later[0].task_id,)
        )
        await check()
        # the purge of finished and ancient tasks (a PENDING one among them)
        await results.execute(
            "UPDATE tasks SET submission_date = now() - interval '400 days' WHERE task_id = %s",
            (b[2].task_id,),
        )
        await purge(results, max_age=300 * 86400)
        await check()
        assert await compact_backlog(results)
        await check()
        assert (await _backlog(results))[("svc-b", "c2")] == 1
        # the counts answer the capacity checks
        service = await results.execute(_PENDING_SERVICE, {"service": "svc-a"})
        assert (await service.fetchone())[0] == sum(
            n for (s, _), n in (await _live(results)).items() if s == "svc-a"
        )
        client = await results.execute(_PENDING_CLIENT, {"service": "svc-a", "client_id": "c2"})
        assert (await client.fetchone())[0] == 3
        await results.execute("TRUNCATE tasks CASCADE")
        assert await _backlog(results) == {}


@pytest.mark.timeout(60)
def test_the_counts_follow_every_change_of_a_pending_task(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_every_change(url))


async def _deep(url: str) -> None:
    async with await connect(url) as conn:
        for block in range(1, 4):  # 1,000 PENDING tasks in each of three blocks of row ids
            await conn.execute(f"ALTER TABLE tasks ALTER COLUMN id RESTART {block << BLOCK_BITS}")
            for _ in range(10):
                await _submit(conn, "deep", "c1", 100)
        past = datetime.now(UTC) - timedelta(minutes=1)
        due = await _submit(conn, "deep", "c2", 2, not_before=past)  # they count
        await _submit(conn, "deep", "c2", 5, not_before=past + timedelta(days=1))  # not yet
        await _submit(conn, "other", "c1", 50)
        rows = await _submit(conn, "deep", "c1", 3)
        assert [row.position for row in rows] == [3003, 3004, 3005]
        assert await _blocks(conn) == await _live_blocks(conn)
        # The statement reads a few rows of `tasks`, not the 3,000 ahead of the new ones.
        explain = await conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + _INSERT, {**_batch("c1", 1), "service": "deep"}
        )
        plan = (await explain.fetchone())[0][0]["Plan"]
        read = [n["Actual Rows"] for n in _nodes(plan) if n.get("Relation Name") == "tasks"]
        assert read and max(read) <= 10, read
        # A poll's position: exact, anywhere in the backlog, reading at most its own block.
        ids = await (
            await conn.execute(
                "SELECT id FROM tasks WHERE service = 'deep' AND status = 'PENDING' ORDER BY id"
            )
        ).fetchall()
        some = [ids[0].id, ids[999].id, ids[1000].id, ids[2500].id, due[1].row_id, ids[-1].id]
        for row_id in some:
            counted, live = await _positions(conn, "deep", row_id)
            assert counted == live, row_id
        explain = await conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + _POSITION, {"service": "deep", "id": ids[-1].id}
        )
        plan = (await explain.fetchone())[0][0]["Plan"]
        read = [n["Actual Rows"] for n in _nodes(plan) if n.get("Relation Name") == "tasks"]
        assert read and max(read) <= 1100, read  # its own block at most; 3,000+ ahead
        # Tasks leave the front, from another backend: their blocks drain, and the reaper's
        # pass merges every backend's counts and forgets the blocks left with none.
        async with await connect(url) as other:
            await other.execute(
                "UPDATE tasks SET status = 'IN_PROGRESS' WHERE service = 'deep' AND id < %s",
                (2 << BLOCK_BITS,),
            )
        assert await _blocks(conn) == await _live_blocks(conn)
        assert await compact_backlog(conn)
        left = await (await conn.execute("SELECT block, shard FROM task_backlog_blocks")).fetchall()
        assert {row.shard for row in left} == {-1}  # merged
        assert 1 not in {row.block for row in left}  # drained, forgotten
        assert await _blocks(conn) == await _live_blocks(conn)
        assert await _backlog(conn) == await _live(conn)
        assert await _positions(conn, "deep", ids[-1].id) == (2006, 2006)  # blocks 2 and 3, 2 due


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _nodes(child))]


@pytest.mark.timeout(60)
def test_a_position_behind_a_deep_backlog_is_exact_without_reading_it(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_deep(url))


async def _due_at_once_beside_an_earlier_writer(url: str) -> None:
    async with await connect(url) as batch, await connect(url) as intake:
        await _submit(intake, "svc", "c1", 1)  # the service, and one task ahead of both
        # A batch's transaction began (`now()` fixed) before an immediate submission took the
        # service's writer lock and committed: the batch's row comes after, its id higher.
        await batch.set_autocommit(False)
        await batch.execute("SELECT 1")
        await asyncio.sleep(0.05)
        [immediate] = await _submit(intake, "svc", "c1", 1)
        rows = await batch.execute(
            _INSERT, {**_batch("c1", 1), "delays": [0.0], "service": "svc"}
        )  # `delaySeconds: 0`: due at once
        [due_now] = await rows.fetchall()
        await batch.commit()
        places = [await _positions(intake, "svc", row.row_id) for row in (immediate, due_now)]
        # Each counted the other ahead of it (the immediate one by time, the other by row
        # id), and both answered 3: one place twice, one never.
        assert places == [(2, 2), (3, 3)], places


def test_a_task_due_at_once_takes_its_own_place_beside_an_earlier_writer(database_url: str) -> None:
    """Found by a black-box sweep: batches of `delaySeconds: 0` racing single submissions
    gave two PENDING tasks one `taskPosition` (and skipped another), 25 times in 1,000. A
    task's time was its transaction's start, before it waited for its service's writer lock,
    while its row id is taken after: the two orders disagreed. Its time is now taken once it
    holds the lock (the insert's own start), so they follow each other."""
    with scratch_database(database_url) as url:
        asyncio.run(_due_at_once_beside_an_earlier_writer(url))


def test_the_triggers_are_in_place(database_url: str) -> None:
    """A database without them would count wrong silently: the migration installs four."""
    with psycopg.connect(libpq(database_url)) as conn:
        names = {
            row[0]
            for row in conn.execute(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'tasks'::regclass"
                " AND tgname LIKE 'tasks_backlog_%'"
            )
        }
    assert names == {
        "tasks_backlog_added",
        "tasks_backlog_updated",
        "tasks_backlog_deleted",
        "tasks_backlog_truncated",
    }


async def _compact_while_written(url: str) -> None:
    async with await connect(url) as writer, await connect(url) as reaper:
        await _submit(writer, "svc", "c1", 5)
        # A transaction still open holds its backend's counts while the reaper passes: the
        # pass skips them rather than wait, and nothing is lost either way.
        await writer.set_autocommit(False)
        await _submit(writer, "svc", "c1", 1)
        assert await asyncio.wait_for(compact_backlog(reaper), timeout=5)
        await writer.commit()
        assert await _backlog(reaper) == await _live(reaper) == {("svc", "c1"): 6}
        assert await _blocks(reaper) == await _live_blocks(reaper)
        assert await compact_backlog(reaper)
        shards = await (await reaper.execute("SELECT DISTINCT shard FROM task_backlog")).fetchall()
        assert {row.shard for row in shards} == {-1}
        # One pass at a time: a second reaper finds the first one's lock and leaves.
        await writer.execute("SELECT pg_advisory_xact_lock(hashtext('conveyor.backlog'))")
        assert not await compact_backlog(reaper)
        await writer.rollback()


@pytest.mark.timeout(60)
def test_compacting_the_counts_never_waits_nor_loses_a_count(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_compact_while_written(url))
