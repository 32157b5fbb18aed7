"""Cancelling a task (SPEC §11.1): FAILURE at once in the database, then word to the
dispatchers.

The database decides: the task becomes FAILURE `Task cancelled.` through the state machine's
guarded statement (`lifecycle.failure`), so a result that arrives later changes nothing
(terminal wins), whether a dispatcher heard the cancel or not. The broadcast on the service's
`<queue>-control` exchange (and on those of the queue names it moved away from, whose
dispatchers may still be running its tasks) only spares the function's work: a dispatcher running the task
aborts the call (the function sees its connection closed) and acks the message; one that
receives it later acks it without a call, and so does one started later (scaled from zero, a
Job), which reads the service's `<queue>-cancels` stream, bound to the exchange with the
service's first cancel, before it takes any submission. The word itself is kept by the
database until the broker took it (`untold_cancels`, written with the change that ends the
task): if the broadcast cannot be sent (the broker is down, the process is killed), any
gateway tells it once the broker takes it (`Broadcast.retry_loop`); a dispatcher that
reconnects first may start the call meanwhile, which the cancel then aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from functools import partial
from typing import Any

import psycopg

from conveyor import logs, topology
from conveyor.events import encode_cancel
from gateway import errors, lifecycle, metrics, supervisor
from gateway.broker import Broker, ExchangeMissing, PublishError
from gateway.catalog import Service
from gateway.pgpool import CONNECTION_ERRORS as DATABASE_AWAY
from gateway.pgpool import Pool
from gateway.store import get_task, task_status

log = logging.getLogger("conveyor.gateway.cancel")

_PIPELINED = 100  # cancels in flight at once, when a delete ends many tasks

CANCELLED = "Task cancelled."
UNFINISHED = ("PENDING", "IN_PROGRESS")
# What tells a cancelled task from one its function failed with the same message.
_MARK_CANCELLED = "UPDATE tasks SET cancelled_at = now() WHERE task_id = %(task_id)s"
_CANCELLED = "SELECT cancelled_at IS NOT NULL FROM tasks WHERE task_id = %(task_id)s"
_LOCK = "SELECT 1 FROM tasks WHERE task_id = %(task_id)s FOR UPDATE"


async def _cancelled(pool: Pool, task_id: uuid.UUID) -> bool:
    async with pool.connection() as conn:
        row = await (await conn.execute(_CANCELLED, {"task_id": task_id})).fetchone()
    return bool(row and row[0])


async def cancel_task(
    pool: Pool, broadcast: Broadcast, client_id: str, service: Service, task_id: uuid.UUID
) -> tuple[dict[str, Any], bool]:
    """The task's poll data once cancelled, and whether this call finished it (the notifier
    then has a callback to send if it has one). 409001 if it had finished otherwise."""
    status = await task_status(pool, client_id, service.name, task_id)  # 404002 for strangers
    finished_now = False
    queue_names = await _queue_names(pool, service.name)
    if status in UNFINISHED:
        async with pool.connection() as conn, conn.transaction():
            # Its endDate is when it takes effect: after the waits for a connection and for
            # the row (a result being applied), not when it was decided (a sweep found
            # cancels ended seconds before they took effect, before their call had begun).
            await conn.execute(_LOCK, {"task_id": task_id})
            change = lifecycle.failure(task_id, CANCELLED)
            outcome = await lifecycle.apply(conn, change)
            finished_now = outcome.applied is lifecycle.Applied.FINISHED
            if finished_now:
                await conn.execute(_MARK_CANCELLED, {"task_id": task_id})
                await keep(conn, service.name, queue_names, [task_id])
        if (done := outcome.finished) is not None:
            metrics.task_finished(done.service, done.status, done.waited, done.ran)
    if not finished_now:
        if not await _cancelled(pool, task_id):
            raise errors.ApiError(errors.ALREADY_FINISHED)
        # A repeat is told again: the first may have been answered 503 after its commit,
        # or its gateway killed before its broadcast; a dispatcher that hears it twice acks once.
        async with pool.connection() as conn:
            await keep(conn, service.name, queue_names, [task_id])
    data = await get_task(pool, client_id, service.name, task_id)
    await broadcast.tell(service.name, queue_names, [task_id])
    return data, finished_now


async def _queue_names(pool: Pool, service: str) -> list[str]:
    async with pool.connection() as conn:
        return await _queue_names_on(conn, service)


async def _queue_names_on(conn: psycopg.AsyncConnection[Any], service: str) -> list[str]:
    """Where the service's dispatchers may be: its queue, and the ones it moved away from
    while their dispatchers still run (they finish what they took, and an abort must reach
    them too). A legacy service's too: the seed's workers ignore the exchange, and Conveyor's
    dispatcher serving the queue hears it whatever the format."""
    cursor = await conn.execute(
        "SELECT queue_name FROM services WHERE name = %(service)s"
        " UNION ALL SELECT queue_name FROM moved_queues WHERE service = %(service)s",
        {"service": service},
    )
    return [row[0] for row in await cursor.fetchall()]


async def keep_ended(conn: psycopg.AsyncConnection[Any], ended: dict[str, list[uuid.UUID]]) -> None:
    """`keep` for tasks the platform ended while they were still queued or running (the
    watchdog's), per service, in the transaction that ends them: written afterwards, a
    database error in between lost them, and a dispatcher started later called the functions
    of the failed tasks (found by a sweep)."""
    for service, task_ids in ended.items():
        await keep(conn, service, await _queue_names_on(conn, service), task_ids)


async def tell_ended(pool: Pool, broadcast: Broadcast, ended: dict[str, list[uuid.UUID]]) -> None:
    """The tasks `keep_ended` kept, told to their dispatchers as cancels are: a message a
    crashed worker left is then acked without a call, and a call still under way (its
    dispatcher frozen past the limit) is aborted. What the broker does not take now, the loop
    tells later."""
    for service, task_ids in ended.items():
        if not await broadcast.tell(service, await _queue_names(pool, service), task_ids):
            return  # the broker is away for the others too: the loop tells them


# A cancel's row waits this long before a gateway's loop takes it: the process that wrote it
# tells the dispatchers at once, within a publish timeout, and removes it.
TELL_GRACE = 10.0
# A row a loop took is leased this long: one whose process dies mid-broadcast is taken again.
LEASE = 30.0
# While the broker takes no cancel, how often the loop tries again.
RETRY_INTERVAL = 1.0
# How often the loop looks for cancels it was not woken for: kept by another process (an API
# worker of `--workers`, a gateway killed before telling them). Not every second: an idle
# gateway would make four round trips to the database each time, for nothing.
POLL_INTERVAL = 10.0
# The rows a pass of the loop takes at most.
BATCH = 1000

_KEEP = """
    INSERT INTO untold_cancels (task_id, service, queue_names, retry_at)
    SELECT t, %(service)s, %(queues)s, now() + make_interval(secs => %(after)s)
      FROM unnest(CAST(%(ids)s AS uuid[])) AS t
    ON CONFLICT (task_id) DO UPDATE
       SET service = EXCLUDED.service, queue_names = EXCLUDED.queue_names,
           retry_at = LEAST(untold_cancels.retry_at, EXCLUDED.retry_at)
    """
_TOLD = "DELETE FROM untold_cancels WHERE task_id = ANY(%(ids)s)"
_CLAIM = """
    UPDATE untold_cancels SET retry_at = now() + make_interval(secs => %(lease)s)
     WHERE task_id IN (SELECT task_id FROM untold_cancels WHERE retry_at <= now()
                        ORDER BY retry_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING task_id, service, queue_names
    """


async def keep(
    conn: psycopg.AsyncConnection[Any],
    service: str,
    queue_names: list[str],
    task_ids: list[uuid.UUID],
    after: float = TELL_GRACE,
) -> None:
    """The cancels kept untold, due for the loop `after` seconds from now (sooner if they were
    due already), in the caller's transaction: the change that ended the tasks."""
    if task_ids:
        params = {"service": service, "queues": queue_names, "ids": task_ids, "after": after}
        await conn.execute(_KEEP, params)


async def forget(conn: psycopg.AsyncConnection[Any], task_ids: list[uuid.UUID]) -> None:
    """The cancels the broker took: nothing more to tell."""
    await conn.execute(_TOLD, {"ids": task_ids})


class CancelsUntold(Exception):
    """A pass of the loop found cancels the broker did not take."""


class Broadcast:
    """Cancels told to the dispatchers at once, and those the broker did not take (an outage)
    told again once it takes them, by the loop of whichever gateway runs the background loops.
    A soak found them told never (5 tasks of 5 cancelled during an outage were called once it
    ended), then kept in one process's memory only (a process ended before the broker came
    back took them along): the database keeps them now (`untold_cancels`)."""

    def __init__(self, pool: Pool, broker: Broker) -> None:
        self.pool = pool
        self.broker = broker
        # Cancels this process kept untold, or a broker connection made again: the loop looks now.
        self._due = asyncio.Event()
        broker.on_reconnect(self._due.set)

    async def tell(self, service: str, queue_names: list[str], task_ids: list[uuid.UUID]) -> bool:
        """Whether the broker took them all: their rows go; else they are due for the loop
        now. The callers wrote the rows first (`keep`): one cut off meanwhile (its deadline,
        its process killed) leaves them to the loop after `TELL_GRACE`."""
        told = await tell_dispatchers(self.broker, service, queue_names, task_ids)
        try:
            async with self.pool.connection() as conn:
                if told:
                    await forget(conn, task_ids)
                else:
                    await keep(conn, service, queue_names, task_ids, after=RETRY_INTERVAL)
        except DATABASE_AWAY as exc:  # the rows stay: told again (harmless), or after the grace
            log.warning("cancels' rows not updated", extra={"error": logs.describe(exc)})
        if not told:
            self._due.set()
        return told

    async def retry_loop(self) -> None:
        """Tells the cancels due: kept during an outage, or left by a process that ended
        before telling them; when this process kept some or its broker connection was made
        again, else every `POLL_INTERVAL`. A pass the database or the broker fails is tried
        again after `RETRY_INTERVAL`, named under `failing` in /readyz until one succeeds."""
        wait = RETRY_INTERVAL
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._due.wait()
            if self._due.is_set():
                await asyncio.sleep(RETRY_INTERVAL)  # a grace for the broker just back
                self._due.clear()
            wait = RETRY_INTERVAL  # until a pass succeeds
            with supervisor.one_pass(log, "cancels not told", (*DATABASE_AWAY, CancelsUntold)):
                await self.tell_due()
                wait = POLL_INTERVAL

    async def tell_due(self) -> int:
        """Tells the cancels due now, a batch at a time; how many were told."""
        told = 0
        while True:
            async with self.pool.lease() as conn:
                cursor = await conn.execute(_CLAIM, {"lease": LEASE, "limit": BATCH})
                rows = await cursor.fetchall()
            groups: dict[tuple[str, tuple[str, ...]], list[uuid.UUID]] = {}
            for row in rows:
                groups.setdefault((row.service, tuple(row.queue_names)), []).append(row.task_id)
            for (service, names), task_ids in groups.items():
                if not await self.tell(service, list(names), task_ids):
                    raise CancelsUntold(f"{len(rows) - told} cancels not taken by the broker")
                told += len(task_ids)
            if told:
                log.info("cancels kept untold are told", extra={"tasks": told})
            if len(rows) < BATCH:
                return told


async def tell_dispatchers(
    broker: Broker, service: str, queue_names: list[str], task_ids: list[uuid.UUID]
) -> bool:
    """Broadcasts that the tasks ended on each queue name's `-control` exchange, after
    declaring its `-cancels` stream; False if the broker could not take them all (the tasks
    stay ended; their functions may run, and their results are ignored). A batch of cancels
    (a service deleted) goes out pipelined, and stops at the first refusal: the broker is
    away for the rest too. An exchange deleted since this process declared it (by an
    operator, or with its service's queues) is declared again and the batch sent once more;
    if it still cannot be, the next queue name's are sent all the same."""
    for queue_name in queue_names:
        if not await _declare_log(broker, queue_name, again=False):
            return False  # sent now, they could reach no log: kept for when it can be declared
        for start in range(0, len(task_ids), _PIPELINED):
            chunk = task_ids[start : start + _PIPELINED]
            try:
                try:
                    await _broadcast(broker, service, queue_name, chunk)
                except ExchangeMissing:
                    if not await _declare_log(broker, queue_name, again=True):
                        return False
                    await _broadcast(broker, service, queue_name, chunk)
            except PublishError as exc:
                log.warning(
                    "cancels not broadcast; the tasks stay ended",
                    extra={"queue": queue_name, "tasks": len(task_ids), "error": str(exc)},
                )
                if isinstance(exc, ExchangeMissing):
                    break  # this exchange's: the broker takes the others'
                return False
    return True


async def _declare_log(broker: Broker, queue_name: str, again: bool) -> bool:
    """The queue name's `-control` exchange and `-cancels` stream, once per process (or
    `again`, once found deleted); whether they are there. Not while the broker is away (a
    declaration would wait out its timeout). A cancel is not told before: the exchange
    comes with the service's queues, and a broadcast to it with no log bound was confirmed,
    counted as told, and heard by no dispatcher started later (found right after an outage,
    the publishing channel not restored yet)."""
    key = topology.cancel_log(queue_name)
    if again:
        broker.forget(key)
    if not broker.connected:
        log.warning(
            "cancels not broadcast; the tasks stay ended",
            extra={"queue": queue_name, "error": "the broker is not connected"},
        )
        return False
    try:
        await broker.declare_once(key, partial(topology.declare_cancel_log, queue_name=queue_name))
    except PublishError as exc:
        log.warning(
            "cancel log not declared; a dispatcher started later would not know these cancels",
            extra={"queue": queue_name, "error": str(exc)},
        )
        return False
    return True


async def _broadcast(
    broker: Broker, service: str, queue_name: str, task_ids: list[uuid.UUID]
) -> None:
    """One cancel per task on the queue name's `-control` exchange, pipelined. Every publish
    in flight fails with the channel a missing exchange closes: ExchangeMissing if any says
    so, else the first error."""
    exchange = topology.control_exchange(queue_name)
    outcomes = await asyncio.gather(
        *(broker.publish(encode_cancel(str(t), service), "", exchange) for t in task_ids),
        return_exceptions=True,
    )
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    for error in failed:
        if isinstance(error, ExchangeMissing):
            raise error
    if failed:
        raise failed[0]
