"""The task store: creating a task (capacity, idempotency, outbox) and reading one.

A task is accepted once its row is committed; the row is its own outbox entry
(`publish_at`: when the relay may publish it, should the fast path not have), and
publishing happens after the commit (see `outbox`).

A service's submissions are written one transaction at a time, across every gateway
replica, on a transaction-scoped advisory lock (`WRITER_LOCK`): the capacity counts and a new
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

import hashlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import AsyncConnection

from conveyor import strict_json
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
    # with an Idempotency-Key: the request's `fingerprint`, kept with the key, so that the key
    # answers only a repeat of the same request (a batch: the whole batch's, on each of its rows)
    fingerprint: bytes | None = None
    delay: int | None = None  # run later, in seconds from the submission (never with not_before)


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
# A task's time is the statement's start (`statement_timestamp()`), which comes after its
# service's writer lock, not its transaction's (`now()`), which may come before: a
# transaction begun before another writer's, and locked after it, dated its rows earlier
# than that writer's though their ids came later, and a task due at once (`delaySeconds: 0`)
# then shared a `taskPosition` with its neighbour. Within a service, times and ids now
# follow each other, as `_place` assumes.
# The service is a scalar, not grouped out of the rows: with it, PostgreSQL's generic plan
# costs no more than a custom one, so the prepared statement stops being planned again at
# every execution (its planning took ~0.4 ms, more than its execution; bench/README.md).
def _insert(fingerprints: bool) -> str:
    """The insert; with `fingerprints`, each row also keeps its request's fingerprint
    (`%(fingerprints)s`: the Idempotency-Key's request, see `fingerprint`)."""
    fingerprint_in, fingerprint_col, fingerprint = (
        (", CAST(%(fingerprints)s AS bytea[])", ", idempotency_fingerprint", ", fingerprint")
        if fingerprints
        else ("", "", "")
    )
    return f"""
    WITH given AS (
        SELECT * FROM unnest(CAST(%(task_ids)s AS uuid[]), CAST(%(client_ids)s AS text[]),
                             CAST(%(requests)b AS text[]), CAST(%(callbacks)s AS jsonb[]),
                             CAST(%(keys)s AS text[]), CAST(%(not_befores)s AS timestamptz[]),
                             CAST(%(delays)s AS float8[]),
                             CAST(%(traceparents)s AS text[]){fingerprint_in})
               WITH ORDINALITY AS i(task_id, client_id, request, callback, key, at, delay,
                                    traceparent{fingerprint}, n)
    ), input AS (
        -- a delay counts from the submission, on the database's clock (as its date does)
        SELECT *, statement_timestamp() AS submitted,
               COALESCE(at, statement_timestamp() + make_interval(secs => delay)) AS not_before
          FROM given
    ), ins AS (
        -- the row is its own outbox entry: the relay may take it after the fast path's grace,
        -- or at its time (a past notBefore is published at once)
        INSERT INTO tasks (task_id, client_id, service, request, request_json, callback, idempotency_key,
                           submission_date, not_before, traceparent, publish_at, time_limit,
                           expires_at{fingerprint_col})
        SELECT task_id, client_id, %(service)s, CAST(request AS jsonb), CAST(request AS json),
               callback, key, submitted,
               -- a time already past means now: the time to live counts from the submission
               CASE WHEN not_before < submitted THEN submitted ELSE not_before END, traceparent,
               CASE WHEN not_before > submitted THEN not_before
                    ELSE submitted + make_interval(secs => %(grace)s) END,
               %(time_limit)s,
               GREATEST(not_before, submitted) + make_interval(secs => %(time_to_live)s){fingerprint}
          FROM input
         -- a service deleted while this waited for its writer lock takes no more tasks
         WHERE EXISTS (SELECT FROM services WHERE name = %(service)s)
         ORDER BY n
        RETURNING id, task_id, not_before, COALESCE(not_before > submission_date, false) AS delayed,
                  expires_at
    )
    SELECT ins.task_id, ins.id AS row_id, ins.delayed, ins.expires_at,
           CASE WHEN ins.delayed THEN 0  -- not due yet: no place in the queue (SPEC §11.4)
           ELSE (SELECT COALESCE(sum(b.pending), 0)::bigint FROM task_backlog_blocks b
                  WHERE b.service = %(service)s)
                + (SELECT count(*) FROM tasks t
                    WHERE t.service = %(service)s AND t.status = 'PENDING'
                      AND t.not_before IS NOT NULL AND t.not_before <= statement_timestamp())
                + count(*) FILTER (WHERE NOT ins.delayed) OVER (ORDER BY ins.id)
           END AS position
      FROM ins
    """


_INSERT = _insert(fingerprints=False)  # the intake's: no Idempotency-Key
_INSERT_KEYED = _insert(fingerprints=True)
BLOCK_BITS = 10  # `task_backlog_blocks` counts by blocks of 1,024 row ids (migration 0008)


def _place(task: str) -> str:
    """A lateral join (`k`) saying where the PENDING task `task` (a row of `tasks`) entered the
    service's queue, for `_PLACE_OF`: `entry`, when it became due (its submission, or its
    `notBefore`), and `bound`, the last row id submitted by then. A task that was due when
    submitted entered at its own row; a task that waited for its time entered behind every row
    submitted before it became due: the newest row submitted by then, found on
    `ix_tasks_submission_date` (two probes, whatever the service; ids and submission times
    follow each other, each service's rows being written one transaction at a time)."""
    return f"""
    CROSS JOIN LATERAL (
        SELECT {task}.id, COALESCE({task}.not_before, {task}.submission_date) AS entry,
               CASE WHEN {task}.not_before IS NULL OR {task}.not_before <= {task}.submission_date
                    THEN {task}.id
                    ELSE GREATEST({task}.id, (
                        SELECT max(g.id) FROM tasks g
                         WHERE g.submission_date = (
                             SELECT max(h.submission_date) FROM tasks h
                              WHERE h.submission_date <= {task}.not_before)))
               END AS bound
        OFFSET 0  -- computed once, not once for each use of `bound`
    ) k"""


# The place of a PENDING, due task in its service's queue (`k`: where it entered, `_place`),
# in the order tasks entered the queue (SPEC §3.1, §11.4): a run-later task joins its tail when
# due, behind the tasks submitted before then, whatever their row ids; no one already in the
# queue is moved back. The tasks without a `notBefore` up to `bound`: the blocks before its
# own, then the rows of its own block up to it (a few hundred rows at most, not every PENDING
# task ahead); then the run-later tasks that became due before it (counted live on
# `ix_tasks_pending_later`: no trigger sees a time pass), itself included.
_PLACE_OF = f"""
    (SELECT COALESCE(sum(b.pending), 0)::bigint FROM task_backlog_blocks b
      WHERE b.service = %(service)s AND b.block < k.bound >> {BLOCK_BITS})
    + (SELECT count(*) FROM tasks p
        WHERE p.service = %(service)s AND p.status = 'PENDING' AND p.not_before IS NULL
          AND p.id >= (k.bound >> {BLOCK_BITS}) << {BLOCK_BITS} AND p.id <= k.bound)
    + (SELECT count(*) FROM tasks p
        WHERE p.service = %(service)s AND p.status = 'PENDING' AND p.not_before IS NOT NULL
          AND p.not_before <= k.entry AND (p.not_before, p.id) <= (k.entry, k.id))"""


# One writer of a service's tasks at a time (see the module's docstring); the statement after
# it takes its snapshot once the lock is held, so it sees the previous writer's commit.
WRITER_LOCK = "SELECT pg_advisory_xact_lock(hashtext('conveyor.capacity'), hashtext(%(service)s))"
# The backlog as `task_backlog` keeps it (migration 0008): a few rows, however deep it is.
_PENDING_SERVICE = (
    "SELECT COALESCE(sum(pending), 0)::bigint FROM task_backlog WHERE service = %(service)s"
)
_PENDING_CLIENT = (
    "SELECT COALESCE(sum(pending), 0)::bigint FROM task_backlog"
    " WHERE service = %(service)s AND client_id = %(client_id)s"
)
_BY_KEY = """
    SELECT id, task_id, status, submission_date, not_before, idempotency_fingerprint FROM tasks
    WHERE client_id = %(client_id)s AND service = %(service)s AND idempotency_key = %(key)s
    """
_FORGET_KEY = "UPDATE tasks SET idempotency_key = NULL WHERE id = %(id)s"
_BY_KEYS = f"""
    SELECT t.id, t.task_id, t.submission_date, t.idempotency_key, t.idempotency_fingerprint,
           CASE WHEN t.status = 'PENDING' AND (t.not_before IS NULL OR t.not_before <= now())
                THEN {_PLACE_OF} ELSE 0 END AS position
      FROM tasks t {_place("t")}
     WHERE t.client_id = %(client_id)s AND t.service = %(service)s
       AND t.idempotency_key >= %(key)s || E'\\n' AND t.idempotency_key < %(key)s || E'\\x0b'
    """
_FORGET_KEYS = "UPDATE tasks SET idempotency_key = NULL WHERE id = ANY(%(ids)s)"
# Whether a batch used the key within the window (a single submission's key then is refused).
_BATCH_KEY_USED = """
    SELECT EXISTS (
        SELECT FROM tasks t
         WHERE t.client_id = %(client_id)s AND t.service = %(service)s
           AND t.idempotency_key >= %(key)s || E'\\n' AND t.idempotency_key < %(key)s || E'\\x0b'
           AND t.submission_date >= %(since)s)
    """
# A PENDING, due task's place, by its row id (0 if the row is gone).
_POSITION = f"""
    SELECT COALESCE((SELECT {_PLACE_OF} FROM tasks r {_place("r")}
                      WHERE r.id = CAST(%(id)s AS bigint)), 0)"""


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
    await conn.execute(WRITER_LOCK, {"service": first.access.service.name})
    if first.idempotency_key is not None:
        found = await repeat(conn, tasks)
        if found is not None:
            return found
    if limited:
        await _check_capacity(conn, first, len(tasks))
    return await insert_many(conn, tasks, grace)


async def earlier_request(
    pool: Pool,
    client_id: str,
    access: Access,
    key: str,
    fingerprint: bytes | None,
    batch_size: int | None = None,
) -> list[Accepted] | None:
    """What an Idempotency-Key was used for, as a repeat of the same request answers it (a
    batch of `batch_size` tasks, or a single task), or None; `key_reused()` for another
    request. Asked when a repeat is refused by today's checks: the service's schema, the
    callback policy or the longest delay may have changed since the task was accepted, and a
    client retrying after a lost answer must be told its task, not that it was refused."""
    keys = [key] if batch_size is None else [f"{key}\n{i}" for i in range(batch_size)]
    probes = [NewTask(client_id, access, {}, None, k, 0.0, fingerprint=fingerprint) for k in keys]
    async with pool.connection() as conn, conn.transaction():
        if batch_size is None:
            return await _single_repeat(conn, probes)
        return await _batch_repeat(conn, probes)


async def _single_repeat(conn: AsyncConnection[Any], tasks: list[NewTask]) -> list[Accepted] | None:
    """The task submitted earlier under the same key; None if there is none. A key is one
    request: one used for a batch, or for another request, is refused."""
    new = tasks[0]
    found = await _idempotent_repeat(conn, new)
    if found is not None:
        return [found]
    if await _count(conn, _BATCH_KEY_USED, {**_key_params(new), "since": _window_start()}):
        raise key_reused()
    return None


async def _batch_repeat(conn: AsyncConnection[Any], tasks: list[NewTask]) -> list[Accepted] | None:
    """The batch submitted earlier under the same key, in its order; None if there is none.
    A key is one request: one used for a single task, or for another batch, is refused."""
    first = tasks[0]
    key = (first.idempotency_key or "").rpartition("\n")[0]  # every task of the batch
    params = {**_key_params(first), "key": key}
    rows = await (await conn.execute(_BY_KEYS, params)).fetchall()
    if rows and rows[0].submission_date < _window_start():
        await conn.execute(_FORGET_KEYS, {"ids": [row.id for row in rows]})
        rows = []
    if not rows:
        single = await (await conn.execute(_BY_KEY, params)).fetchone()
        if single is not None and single.submission_date >= _window_start():
            raise key_reused()
        return None
    # another size, or (rows from before migration 0013 have no fingerprint) another request
    if len(rows) != len(tasks) or not all(_same(row, first) for row in rows):
        raise key_reused()
    by_key = {row.idempotency_key: row for row in rows}
    return [
        Accepted(row.task_id, row.position, False, None)
        for row in (by_key[t.idempotency_key] for t in tasks)
    ]


class KeyReused(errors.ApiError):
    """The key was used for another request: refused only once the request passed every
    check of its own (docs/api.md's order: the request's own errors come first)."""


def key_reused() -> KeyReused:
    refused = errors.invalid("Idempotency-Key", "already used for a different request")
    return KeyReused(refused.kind, refused.errors)


def fingerprint(request: Any) -> bytes:
    """What an Idempotency-Key is kept with: a hash of `request` (what the submission asked
    for, as JSON) in canonical JSON, its keys sorted. The same request gives the same bytes,
    whatever the order of its keys or its spacing."""
    return hashlib.sha256(strict_json.dumps(request, sort_keys=True)).digest()


def _same(row: Any, new: NewTask) -> bool:
    """Whether the row's key was used for `new`'s request; a row from before the fingerprints
    (migration 0013) has none, and is taken as the same, as before."""
    stored = row.idempotency_fingerprint
    return stored is None or new.fingerprint is None or bytes(stored) == new.fingerprint


def _key_params(new: NewTask) -> dict[str, Any]:
    return {
        "client_id": new.client_id,
        "service": new.access.service.name,
        "key": new.idempotency_key,
    }


def _window_start() -> datetime:
    return datetime.now(UTC) - IDEMPOTENCY_WINDOW


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
    that holds the service's `WRITER_LOCK`; answers in input order."""
    ids, params = _insert_params(tasks, grace)
    params["fingerprints"] = [t.fingerprint for t in tasks]
    return _accepted(ids, await (await conn.execute(_INSERT_KEYED, params)).fetchall())


async def insert_in_turn(pool: Pool, tasks: list[NewTask], grace: float) -> list[Accepted]:
    """The intake's insert: the service's lock, the insert and the commit in one round trip
    (`Pool.batch`); answers in input order."""
    ids, params = _insert_params(tasks, grace)
    async with pool.batch() as conn:
        await conn.execute(WRITER_LOCK, params)
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
        # as text, each cast on its own, in binary (`%(requests)b`): PostgreSQL read an array
        # literal of large documents in quadratic time, a jsonb[] of many objects as a text[]
        # of many quotes or backslashes (15 bodies of 1 MB: 5 to 8 s, past the statement
        # timeout; 0.05 to 0.3 s so)
        "requests": [strict_json.dumps(t.body).decode() for t in tasks],
        "callbacks": [jsonb(t.callback) for t in tasks],
        "keys": [t.idempotency_key for t in tasks],
        "not_befores": [t.not_before for t in tasks],
        "delays": [t.delay for t in tasks],
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
    if len(rows) != len(ids):  # the insert found its service deleted
        raise errors.ApiError(errors.SERVICE_NOT_FOUND)
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
            raise errors.ApiError(errors.SERVICE_CAPACITY, headers=dict(errors.RETRY_SOON))
    if new.access.client_capacity is not None:
        if await _count(conn, _PENDING_CLIENT, params) + count > new.access.client_capacity:
            raise errors.ApiError(errors.CLIENT_CAPACITY, headers=dict(errors.RETRY_SOON))


async def _idempotent_repeat(conn: AsyncConnection[Any], new: NewTask) -> Accepted | None:
    row = await (await conn.execute(_BY_KEY, _key_params(new))).fetchone()
    if row is None:
        return None
    if row.submission_date < _window_start():
        await conn.execute(_FORGET_KEY, {"id": row.id})
        return None
    if not _same(row, new):
        raise key_reused()
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

# A task as its owner reads it: another client's, or another service's, is no row at all, and
# costs no read of its response (found by a black-box sweep: a stranger's 404002 for a task
# with a 900 KB response took 4 to 8 times as long as for an unknown id, telling it exists).
_OWNED = """
    FROM tasks WHERE task_id = %(task_id)s AND client_id = %(client_id)s AND service = %(service)s
    """
_GET = f"""
    SELECT id, task_id, status, submission_date, start_date, end_date,
           progress, response, error_message, worker_host, not_before {_OWNED}"""
_STATUS = f"SELECT status {_OWNED}"


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
    params = _owner(client_id, service, task_id)
    async with pool.connection() as conn:
        row = _found(await (await conn.execute(_GET, params)).fetchone())
        position = None
        if row.status == TaskStatus.PENDING:
            position = await _position_of(conn, service, row.id) if _due(row.not_before) else 0
        return task_view(row, position)


async def task_status(pool: Pool, client_id: str, service: str, task_id: uuid.UUID) -> str:
    """The task's status, or 404002: what a cancel and a stream check first, without the
    queue position a poll works out (two more statements for a PENDING task)."""
    async with pool.connection() as conn:
        row = await (await conn.execute(_STATUS, _owner(client_id, service, task_id))).fetchone()
    return str(_found(row).status)


def _owner(client_id: str, service: str, task_id: uuid.UUID) -> dict[str, Any]:
    """`_OWNED`'s parameters."""
    return {"task_id": task_id, "client_id": client_id, "service": service}


def _found(row: Any) -> Any:
    """The caller's row: another client's task, or another service's, does not exist for
    this caller (404002)."""
    if row is None:
        raise errors.ApiError(errors.TASK_NOT_FOUND)
    return row
