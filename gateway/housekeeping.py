"""Housekeeping: the reaper (PENDING past its TTL → FAILURE) and the purge.

The reaper also compacts the backlog counts (migration 0008): otherwise every connection
that ever wrote and every block of row ids a service ever used would keep its rows, and a
position or a capacity check would sum more of them as time goes by.

The purge deletes in batches, each its own short transaction, so it never holds
locks on millions of rows nor bloats one giant transaction; it runs daily as
`conveyor purge` (a CronJob) and is safe to run concurrently with traffic.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from conveyor import logs
from gateway import cancel, lifecycle, metrics, supervisor
from gateway.hearing import Hearing
from gateway.pgpool import MAINTENANCE_TIMEOUT, Pool
from gateway.store import IDEMPOTENCY_WINDOW

log = logging.getLogger("conveyor.gateway.housekeeping")

DEFAULT_RETENTION = 7 * 86400

# A finished task past its service's retention, unless something still needs its row (found
# by a black-box sweep at a retention of seconds): its callback, not delivered yet (the task
# purged first, it was never sent nor recorded), and a repeat of its request within the
# Idempotency-Key's window (IDEMPOTENCY_WINDOW, 24 h: purged, a repeat made a second task;
# a batch's rows, purged one by one, made its identical repeat "a different request").
# PURGE_MAX_AGE (_PURGE_ANCIENT) deletes them all the same.
_PURGE_FINISHED = """
    DELETE FROM tasks WHERE id IN (
        SELECT t.id FROM tasks t LEFT JOIN services s ON s.name = t.service
         WHERE t.status IN ('SUCCESS', 'FAILURE')
           AND t.end_date < now() - make_interval(
                 secs => COALESCE(s.retention_seconds,  %(default_retention)s))
           AND t.notification_status IS DISTINCT FROM 'PENDING'
           AND (t.idempotency_key IS NULL OR t.submission_date < %(keys_since)s)
         LIMIT %(batch)s)
    """
# A task to run later is as old as the time it has been due: counted from its submission, a
# PURGE_MAX_AGE shorter than its delay deleted it before it ran, failed or called back.
_PURGE_ANCIENT = """
    DELETE FROM tasks WHERE id IN (
        SELECT id FROM tasks
         WHERE submission_date < now() - make_interval(secs => %(max_age)s)
           AND (not_before IS NULL OR not_before < now() - make_interval(secs => %(max_age)s))
         LIMIT %(batch)s)
    """
_PURGE_POISON = (
    "DELETE FROM poison_messages WHERE received_at < now() - make_interval(secs => %(max_age)s)"
)


# The reaper's pass over the backlog counts (migration 0008): each backend's rows are merged
# into shard -1, and counts of zero are deleted. Rows a transaction holds are skipped (the next
# pass takes them), so the pass never waits for a lock, and no transaction ever waits for one
# of shard -1's: nothing can deadlock. One pass at a time across replicas (shard -1 is theirs).
_COMPACT_LOCK = "SELECT pg_try_advisory_xact_lock(hashtext('conveyor.backlog'))"
_BACKLOG_KEYS = {
    "task_backlog": ("service", "client_id"),
    "task_backlog_blocks": ("service", "block"),
}


def _compaction(table: str, keys: tuple[str, ...]) -> list[str]:
    columns = ", ".join(keys)
    of_row = ", ".join(f"t.{k}" for k in keys)
    of_taken = ", ".join(f"taken.{k}" for k in keys)
    return [
        f"""
        WITH taken AS (
            SELECT {columns}, shard FROM {table} WHERE shard <> -1 FOR UPDATE SKIP LOCKED
        ), moved AS (
            DELETE FROM {table} t USING taken
             WHERE ({of_row}, t.shard) = ({of_taken}, taken.shard)
            RETURNING {of_row}, t.pending
        )
        INSERT INTO {table} AS b ({columns}, shard, pending)
        SELECT {columns}, -1, sum(pending) FROM moved GROUP BY {columns}
        ON CONFLICT ({columns}, shard) DO UPDATE SET pending = b.pending + EXCLUDED.pending
        """,
        f"DELETE FROM {table} WHERE shard = -1 AND pending = 0",
    ]


async def compact_backlog(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Merges the backlog counts, if no other replica is at it; whether this one was."""
    async with conn.transaction():
        locked = await (await conn.execute(_COMPACT_LOCK)).fetchone()
        if locked is None or not locked[0]:
            return False
        for table, keys in _BACKLOG_KEYS.items():
            for statement in _compaction(table, keys):
                await conn.execute(statement)
    return True


@dataclass(frozen=True, slots=True)
class PurgeReport:
    finished: int
    ancient: int
    poison: int
    batches: int


async def purge(
    conn: psycopg.AsyncConnection[Any], max_age: float, batch: int = 5000
) -> PurgeReport:
    """`conn` in autocommit mode: each batch is its own short transaction."""
    params = {
        "default_retention": DEFAULT_RETENTION,
        "max_age": max_age,
        "batch": batch,
        "keys_since": datetime.now(UTC) - IDEMPOTENCY_WINDOW,
    }
    finished, n1 = await _delete_in_batches(conn, _PURGE_FINISHED, params, batch)
    ancient, n2 = await _delete_in_batches(conn, _PURGE_ANCIENT, params, batch)
    poison = (await conn.execute(_PURGE_POISON, params)).rowcount
    report = PurgeReport(finished, ancient, poison, n1 + n2)
    log.info("purge done", extra=asdict(report))  # a slots dataclass has no __dict__
    return report


async def _delete_in_batches(
    conn: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any], batch: int
) -> tuple[int, int]:
    total = batches = 0
    while True:
        deleted = (await conn.execute(statement, params)).rowcount
        total += deleted
        batches += 1
        if deleted < batch:
            return total, batches


TELL_PATIENCE = 10.0  # for telling the dispatchers of the watchdog's failures, all services


async def reaper_loop(
    pool: Pool,
    ttl: float,
    interval: float,
    on_expired: Callable[[], None],
    hearing: Hearing,
    silence_margin: float = 300.0,
    on_abandoned: Callable[[dict[str, list[uuid.UUID]]], Awaitable[None]] | None = None,
    takes_results: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Ends what nothing else would: PENDING past its time to live, and IN_PROGRESS tasks
    whose worker has said nothing for longer than the service allows (the watchdog), the
    silence counted only while results could be heard (gateway.hearing). The watchdog's
    tasks go to `on_abandoned` once their failure is committed: their dispatchers are told.
    `takes_results` asks the broker whether a worker could publish a result now: while an
    alarm blocks publishes (the connection up), silence counts from the pass after it."""
    with hearing.keeping_time():  # what tells it the process did not run
        while True:
            try:
                expired, abandoned = await _reap(pool, ttl, hearing, silence_margin, takes_results)
                _count(expired, abandoned, on_expired)
                if abandoned and on_abandoned is not None:
                    try:  # best effort, bounded: the next pass must not wait on the broker
                        async with asyncio.timeout(TELL_PATIENCE):
                            await on_abandoned(abandoned)
                    except Exception as exc:  # TimeoutError too: the tasks stay ended
                        log.warning(
                            "watchdog's failures not told", extra={"error": logs.describe(exc)}
                        )
                supervisor.pass_succeeded()
            except Exception as exc:
                supervisor.pass_failed(exc)
                log.warning("reaper pass failed", extra={"error": logs.describe(exc)})
            await asyncio.sleep(interval)


async def _reap(
    pool: Pool,
    ttl: float,
    hearing: Hearing,
    silence_margin: float,
    takes_results: Callable[[], Awaitable[bool]] | None,
) -> tuple[dict[str, int], dict[str, list[uuid.UUID]]]:
    """One pass: the PENDING expired per service, the IN_PROGRESS failed per service."""
    if takes_results is not None and not await takes_results():
        hearing.restarted()  # asked before the connection is taken: it may wait
    abandoned: dict[str, list[uuid.UUID]] = {}
    async with pool.connection(MAINTENANCE_TIMEOUT) as conn:  # one statement each
        expired = await lifecycle.expire_pending(conn, ttl)
        heard_since = hearing.since()  # read now: the statements above may have waited
        if heard_since is not None:
            async with conn.transaction():  # their cancels kept with their failure
                abandoned = await lifecycle.abandon_silent(conn, silence_margin, heard_since)
                await cancel.keep_ended(conn, abandoned)
                if hearing.since() != heard_since:  # it changed meanwhile (e.g. a stall)
                    abandoned = {}
                    raise psycopg.Rollback()
        await compact_backlog(conn)
    return expired, abandoned


def _count(
    expired: dict[str, int], abandoned: dict[str, list[uuid.UUID]], on_expired: Callable[[], None]
) -> None:
    silent_per_service = {service: len(ids) for service, ids in abandoned.items()}
    for failed in (expired, silent_per_service):  # no durations: the platform ended them
        for service, count in failed.items():
            metrics.task_finished(service, "FAILURE", None, None, count)
    reaped, silent = sum(expired.values()), sum(silent_per_service.values())
    if reaped:
        metrics.REAPED.inc(reaped)
        log.info("expired pending tasks", extra={"count": reaped})
    if silent:
        metrics.ABANDONED.inc(silent)
        log.warning("failed silent in-progress tasks", extra={"count": silent})
    if reaped or silent:
        on_expired()
