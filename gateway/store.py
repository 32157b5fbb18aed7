"""The task store: creating a task (capacity, idempotency, outbox) and reading one.

A task is accepted once its row is committed; the row is its own outbox entry
(`publish_at`: when the relay may publish it, should the fast path not have), and
publishing happens after the commit (see `outbox`).

A service's submissions are written one transaction at a time, across every gateway
replica, on a transaction-scoped advisory lock (`_LOCK`): the capacity counts and a new
task's `taskPosition` then see every task committed before it. (Two replicas inserting at
once could not see each other's rows, and both answered the same position.) Within one
process the intake already writes one batch per service at a time, so the lock only ever
waits for another replica.

This is the API's hot path, so it runs on raw psycopg connections in
autocommit mode (`gateway.pgpool`): the common submission (no capacity, no
Idempotency-Key) goes through the intake, whose lock, insert and commit leave in one
round trip (`insert_in_turn`); the others run their statements in an explicit transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import AsyncConnection

from gateway import errors
from gateway.catalog import Access, Service
from gateway.models import TaskStatus
from gateway.pgpool import Pool, jsonb

IDEMPOTENCY_WINDOW = timedelta(hours=24)


@dataclass(frozen=True, slots=True)
class NewTask:
    client_id: str
    access: Access
    body: dict[str, Any]
    callback: dict[str, Any] | None
    idempotency_key: str | None
    time_to_live: float  # seconds a PENDING task lives from its due time (`time_to_live`)
    not_before: datetime | None = None  # run later: published once due (SPEC §11.4)
    traceparent: str | None = None  # the task's trace, for the gateway's later spans


@dataclass(frozen=True, slots=True)
class Accepted:
    task_id: uuid.UUID
    position: int
    created: bool  # False: an idempotent repeat of an earlier submission
    row_id: int | None  # the task row, marked published once the broker confirms
    delayed: bool = False  # waits for its time: the relay publishes it
    expires_at: datetime | None = None  # when it fails if still PENDING; its message's expiry


# Any number of tasks of one service in one statement (the intake batches concurrent
# submissions by service). The tasks ahead are the service's backlog as `task_backlog_blocks`
# counts it, plus the run-later tasks already due (counted live: no trigger sees a time pass). Both
# read the snapshot taken before the statement, which holds none of the new rows (the
# triggers add them after it): those are numbered within the batch instead.
# The service is a scalar, not grouped out of the rows: with it, PostgreSQL's generic plan
# costs no more than a custom one, so the prepared statement stops being planned again at
# every execution (its planning took ~0.4 ms, more than its execution; bench/README.md).
_INSERT = """
    WITH input AS (
        SELECT * FROM unnest(CAST(%(task_ids)s AS uuid[]), CAST(%(client_ids)s AS text[]),
                             CAST(%(requests)s AS jsonb[]), CAST(%(callbacks)s AS jsonb[]),
                             CAST(%(keys)s AS text[]), CAST(%(not_befores)s AS timestamptz[]),
                             CAST(%(traceparents)s AS text[]))
               WITH ORDINALITY AS i(task_id, client_id, request, callback, key, not_before,
                                    traceparent, n)
    ), ins AS (
        -- the row is its own outbox entry: the relay may take it after the fast path's grace,
        -- or at its time (a past notBefore is published at once)
        INSERT INTO tasks (task_id, client_id, service, request, callback, idempotency_key,
                           not_before, traceparent, publish_at, time_limit, expires_at)
        SELECT task_id, client_id, %(service)s, request, callback, key,
               -- a time already past means now: the time to live counts from the submission
               CASE WHEN not_before < now() THEN now() ELSE not_before END, traceparent,
               CASE WHEN not_before > now() THEN not_before
                    ELSE now() + make_interval(secs => %(grace)s) END,
               %(time_limit)s,
               GREATEST(not_before, now()) + make_interval(secs => %(time_to_live)s)
          FROM input ORDER BY n
        RETURNING id, task_id, not_before, COALESCE(not_before > now(), false) AS delayed,
                  expires_at
    )
    SELECT ins.task_id, ins.id AS row_id, ins.delayed, ins.expires_at,
           CASE WHEN ins.delayed THEN 0  -- not due yet: no place in the queue (SPEC §11.4)
           ELSE (SELECT COALESCE(sum(b.pending), 0)::bigint FROM task_backlog_blocks b
                  WHERE b.service = %(service)s)
                + (SELECT count(*) FROM tasks t
                    WHERE t.service = %(service)s AND t.status = 'PENDING'
                      AND t.not_before IS NOT NULL AND t.not_before <= now())
                + count(*) FILTER (WHERE NOT ins.delayed) OVER (ORDER BY ins.id)
           END AS position
      FROM ins
    """
BLOCK_BITS = 10  # `task_backlog_blocks` counts by blocks of 1,024 row ids (migration 0008)


def _position(row_id: str) -> str:
    """The place of the PENDING task `row_id` (an SQL expression) among the service's due
    tasks: the blocks before its own, then the rows of its own block up to it, then the
    run-later tasks already due (counted live; only due tasks are in the queue, SPEC §11.4).
    A few hundred rows at most, not every PENDING task ahead."""
    return f"""
    (SELECT COALESCE(sum(b.pending), 0)::bigint FROM task_backlog_blocks b
      WHERE b.service = %(service)s AND b.block < {row_id} >> {BLOCK_BITS})
    + (SELECT count(*) FROM tasks p
        WHERE p.service = %(service)s AND p.status = 'PENDING' AND p.not_before IS NULL
          AND p.id >= ({row_id} >> {BLOCK_BITS}) << {BLOCK_BITS} AND p.id <= {row_id})
    + (SELECT count(*) FROM tasks p
        WHERE p.service = %(service)s AND p.status = 'PENDING' AND p.not_before IS NOT NULL
          AND p.not_before <= now() AND p.id <= {row_id})"""


# One writer of a service's tasks at a time (see the module's docstring); the statement after
# it takes its snapshot once the lock is held, so it sees the previous writer's commit.
_LOCK = "SELECT pg_advisory_xact_lock(hashtext('conveyor.capacity'), hashtext(%(service)s))"
# The backlog as `task_backlog` keeps it (migration 0008): a few rows, however deep it is.
_PENDING_SERVICE = (
    "SELECT COALESCE(sum(pending), 0)::bigint FROM task_backlog WHERE service = %(service)s"
)
_PENDING_CLIENT = (
    "SELECT COALESCE(sum(pending), 0)::bigint FROM task_backlog"
    " WHERE service = %(service)s AND client_id = %(client_id)s"
)
_BY_KEY = """
    SELECT id, task_id, status, submission_date, not_before FROM tasks
    WHERE client_id = %(client_id)s AND service = %(service)s AND idempotency_key = %(key)s
    """
_FORGET_KEY = "UPDATE tasks SET idempotency_key = NULL WHERE id = %(id)s"
_BY_KEYS = f"""
    SELECT t.id, t.task_id, t.submission_date, t.idempotency_key,
           CASE WHEN t.status = 'PENDING' AND (t.not_before IS NULL OR t.not_before <= now())
                THEN {_position("t.id")} ELSE 0 END AS position
      FROM tasks t
     WHERE t.client_id = %(client_id)s AND t.service = %(service)s
       AND t.idempotency_key >= %(key)s || E'\\n' AND t.idempotency_key < %(key)s || E'\\x0b'
    """
_FORGET_KEYS = "UPDATE tasks SET idempotency_key = NULL WHERE id = ANY(%(ids)s)"
_POSITION = f"SELECT {_position('CAST(%(id)s AS bigint)')}"


Repeat = Callable[[AsyncConnection[Any], list[NewTask]], Awaitable[list[Accepted] | None]]


async def create_task(
    pool: Pool, new: NewTask, batched: Callable[[NewTask], Awaitable[Accepted]], grace: float
) -> Accepted:
    """Stores a task, to be published; `batched` (the intake) writes the common case
    together with others. The relay publishes it `grace` seconds later unless the fast
    path has by then."""
    if _single_statement(new):
        return await batched(new)
    return (await _create_in_transaction(pool, [new], _single_repeat, grace))[0]


async def create_tasks(pool: Pool, tasks: list[NewTask], grace: float) -> list[Accepted]:
    """A batch, all or nothing, in one transaction and one insert. Its tasks share one
    service, client and Idempotency-Key: each task's key is the batch's, a newline and its
    index (a header cannot hold a newline, so no single submission's key collides with one)."""
    return await _create_in_transaction(pool, tasks, _batch_repeat, grace)


async def _create_in_transaction(
    pool: Pool, tasks: list[NewTask], repeat: Repeat, grace: float
) -> list[Accepted]:
    try:
        async with pool.connection() as conn, conn.transaction():
            return await _create(conn, tasks, repeat, grace)
    except psycopg.errors.UniqueViolation:
        # Two concurrent requests with one Idempotency-Key: the loser answers the winner's.
        if tasks[0].idempotency_key is None:
            raise
        async with pool.connection() as conn, conn.transaction():
            found = await repeat(conn, tasks)
        if found is None:
            raise
        return found


async def _create(
    conn: AsyncConnection[Any], tasks: list[NewTask], repeat: Repeat, grace: float
) -> list[Accepted]:
    # The key is looked up under the capacity lock: a repeat that queued behind its own first
    # submission then sees it committed, and answers it rather than counting it against capacity.
    first = tasks[0]
    limited = first.access.service.capacity is not None or first.access.client_capacity is not None
    await conn.execute(_LOCK, {"service": first.access.service.name})
    if first.idempotency_key is not None:
        found = await repeat(conn, tasks)
        if found is not None:
            return found
    if limited:
        await _check_capacity(conn, first, len(tasks))
    return await insert_many(conn, tasks, grace)


async def _single_repeat(conn: AsyncConnection[Any], tasks: list[NewTask]) -> list[Accepted] | None:
    found = await _idempotent_repeat(conn, tasks[0])
    return None if found is None else [found]


async def _batch_repeat(conn: AsyncConnection[Any], tasks: list[NewTask]) -> list[Accepted] | None:
    """The batch submitted earlier under the same key, in its order; None if there is none."""
    first = tasks[0]
    params = {
        "client_id": first.client_id,
        "service": first.access.service.name,
        "key": (first.idempotency_key or "").rpartition("\n")[0],  # every task of the batch
    }
    rows = await (await conn.execute(_BY_KEYS, params)).fetchall()
    if not rows:
        return None
    if rows[0].submission_date < datetime.now(UTC) - IDEMPOTENCY_WINDOW:
        await conn.execute(_FORGET_KEYS, {"ids": [row.id for row in rows]})
        return None
    if len(rows) != len(tasks):  # the key was used for a batch of another size
        raise errors.invalid("Idempotency-Key", "already used for a different batch")
    by_key = {row.idempotency_key: row for row in rows}
    return [
        Accepted(row.task_id, row.position, False, None)
        for row in (by_key[t.idempotency_key] for t in tasks)
    ]


def _single_statement(new: NewTask) -> bool:
    """No idempotency lookup and no capacity check: the insert alone decides."""
    return (
        new.idempotency_key is None
        and new.access.service.capacity is None
        and new.access.client_capacity is None
    )


async def insert_many(
    conn: AsyncConnection[Any], tasks: list[NewTask], grace: float
) -> list[Accepted]:
    """Inserts tasks of one service, to be published, in one statement, in a transaction
    that holds the service's `_LOCK`; answers in input order."""
    ids, params = _insert_params(tasks, grace)
    return _accepted(ids, await (await conn.execute(_INSERT, params)).fetchall())


async def insert_in_turn(pool: Pool, tasks: list[NewTask], grace: float) -> list[Accepted]:
    """The intake's insert: the service's lock, the insert and the commit in one round trip
    (`Pool.batch`); answers in input order."""
    ids, params = _insert_params(tasks, grace)
    async with pool.batch() as conn:
        await conn.execute(_LOCK, params)
        inserted = await conn.execute(_INSERT, params)
    return _accepted(ids, await inserted.fetchall())


def _insert_params(tasks: list[NewTask], grace: float) -> tuple[list[uuid.UUID], dict[str, Any]]:
    service = tasks[0].access.service.name
    if any(t.access.service.name != service for t in tasks):
        raise ValueError("an insert takes the tasks of one service")
    ids = [uuid.uuid4() for _ in tasks]
    params = {
        "service": service,
        "task_ids": ids,
        "client_ids": [t.client_id for t in tasks],
        "requests": [jsonb(t.body) for t in tasks],
        "callbacks": [jsonb(t.callback) for t in tasks],
        "keys": [t.idempotency_key for t in tasks],
        "not_befores": [t.not_before for t in tasks],
        "traceparents": [t.traceparent for t in tasks],
        "grace": grace,
        "time_limit": time_limit(tasks[0].access.service),
        "time_to_live": tasks[0].time_to_live,
    }
    return ids, params


def time_limit(service: Service) -> int:
    """How long the watchdog waits for a word about a task of `service` (before its margin):
    every attempt's timeout, as its message tells the dispatcher. Kept on the row with the
    message's own figures, so that a service changed later does not shorten it."""
    return service.task_timeout * service.max_attempts


def time_to_live(service: Service, pending_ttl: float) -> float:
    """How long a PENDING task of `service` lives from its due time: the gateway's PENDING
    time to live, or the service's retention if shorter. Kept on the row as its message's
    expiry, so that a service changed later moves neither."""
    return min(pending_ttl, float(service.retention_seconds))


def _accepted(ids: list[uuid.UUID], rows: list[Any]) -> list[Accepted]:
    by_id = {row.task_id: row for row in rows}
    return [
        Accepted(i, r.position, True, r.row_id, r.delayed, r.expires_at)
        for i, r in ((i, by_id[i]) for i in ids)
    ]


async def _count(conn: AsyncConnection[Any], query: str, params: dict[str, Any]) -> int:
    row = await (await conn.execute(query, params)).fetchone()
    assert row is not None
    return row[0]


async def _check_capacity(conn: AsyncConnection[Any], new: NewTask, count: int = 1) -> None:
    """Under the service's capacity lock: the counts see every commit. `count` tasks of
    `new`'s service and client must all fit."""
    service = new.access.service
    params = {"service": service.name, "client_id": new.client_id}
    if service.capacity is not None:
        if await _count(conn, _PENDING_SERVICE, params) + count > service.capacity:
            raise errors.ApiError(errors.SERVICE_CAPACITY)
    if new.access.client_capacity is not None:
        if await _count(conn, _PENDING_CLIENT, params) + count > new.access.client_capacity:
            raise errors.ApiError(errors.CLIENT_CAPACITY)


async def _idempotent_repeat(conn: AsyncConnection[Any], new: NewTask) -> Accepted | None:
    params = {
        "client_id": new.client_id,
        "service": new.access.service.name,
        "key": new.idempotency_key,
    }
    row = await (await conn.execute(_BY_KEY, params)).fetchone()
    if row is None:
        return None
    if row.submission_date < datetime.now(UTC) - IDEMPOTENCY_WINDOW:
        await conn.execute(_FORGET_KEY, {"id": row.id})
        return None
    position = 0
    if row.status == TaskStatus.PENDING and _due(row.not_before):
        position = await _position_of(conn, new.access.service.name, row.id)
    return Accepted(row.task_id, position, False, None)


async def _position_of(conn: AsyncConnection[Any], service: str, row_id: int) -> int:
    return await _count(conn, _POSITION, {"service": service, "id": row_id})


def _due(not_before: datetime | None) -> bool:
    """Whether a PENDING task is in the queue; one still waiting has position 0 (§11.4)."""
    return not_before is None or not_before <= datetime.now(UTC)


# ---------------------------------------------------------------------------
# reading a task

_GET = """
    SELECT id, task_id, client_id, service, status, submission_date, start_date, end_date,
           progress, response, error_message, worker_host, not_before
    FROM tasks WHERE task_id = %(task_id)s
    """


def iso(value: datetime | None) -> str | None:
    """ISO-8601 UTC with milliseconds and `Z`, as the seed's examples."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def task_view(row: Any, position: int | None = None) -> dict[str, Any]:
    """The poll's `data` (also the callback body): fields present by status, SPEC §3.2."""
    status = TaskStatus(row.status)
    data: dict[str, Any] = {
        "taskId": str(row.task_id),
        "status": status.value,
        "submitionDate": iso(row.submission_date),
    }
    if row.not_before is not None:
        data["notBefore"] = iso(row.not_before)
    if status is TaskStatus.PENDING:
        data["taskPosition"] = position
        data["progress"] = 0.0
        return data
    if row.start_date is not None:
        data["startDate"] = iso(row.start_date)
    if status is TaskStatus.IN_PROGRESS:
        data["progress"] = float(row.progress)
        return data
    data["endDate"] = iso(row.end_date)
    if status is TaskStatus.SUCCESS:
        data["progress"] = 100.0
        data["response"] = row.response
    else:
        data["progress"] = float(row.progress)
        data["errorMessage"] = row.error_message
    return data


async def get_task(pool: Pool, client_id: str, service: str, task_id: uuid.UUID) -> dict[str, Any]:
    async with pool.connection() as conn:
        row = await (await conn.execute(_GET, {"task_id": task_id})).fetchone()
        # Another client's task, or another service's, does not exist for this caller.
        if row is None or row.client_id != client_id or row.service != service:
            raise errors.ApiError(errors.TASK_NOT_FOUND)
        position = None
        if row.status == TaskStatus.PENDING:
            position = await _position_of(conn, service, row.id) if _due(row.not_before) else 0
        return task_view(row, position)
