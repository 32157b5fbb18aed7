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
service's first cancel, before it takes any submission. If the broadcast cannot be sent (the
broker is down), the cancel still stands; the function may then run to its end, and its
result is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from functools import partial
from typing import Any

from conveyor import topology
from conveyor.events import encode_cancel
from gateway import errors, lifecycle, metrics
from gateway.broker import Broker, ExchangeMissing, PublishError
from gateway.catalog import Service
from gateway.pgpool import Pool
from gateway.store import get_task, task_status

log = logging.getLogger("conveyor.gateway.cancel")

_PIPELINED = 100  # cancels in flight at once, when a delete ends many tasks

CANCELLED = "Task cancelled."
UNFINISHED = ("PENDING", "IN_PROGRESS")
# What tells a cancelled task from one its function failed with the same message.
_MARK_CANCELLED = "UPDATE tasks SET cancelled_at = now() WHERE task_id = %(task_id)s"
_CANCELLED = "SELECT cancelled_at IS NOT NULL FROM tasks WHERE task_id = %(task_id)s"


async def _cancelled(pool: Pool, task_id: uuid.UUID) -> bool:
    async with pool.connection() as conn:
        row = await (await conn.execute(_CANCELLED, {"task_id": task_id})).fetchone()
    return bool(row and row[0])


async def cancel_task(
    pool: Pool, broker: Broker, client_id: str, service: Service, task_id: uuid.UUID
) -> tuple[dict[str, Any], bool]:
    """The task's poll data once cancelled, and whether this call finished it (the notifier
    then has a callback to send if it has one). 409001 if it had finished otherwise."""
    status = await task_status(pool, client_id, service.name, task_id)  # 404002 for strangers
    finished_now = False
    if status in UNFINISHED:
        change = lifecycle.failure(task_id, CANCELLED)
        async with pool.connection() as conn, conn.transaction():
            outcome = await lifecycle.apply(conn, change)
            finished_now = outcome.applied is lifecycle.Applied.FINISHED
            if finished_now:
                await conn.execute(_MARK_CANCELLED, {"task_id": task_id})
        if (done := outcome.finished) is not None:
            metrics.task_finished(done.service, done.status, done.waited, done.ran)
    if not finished_now and not await _cancelled(pool, task_id):
        raise errors.ApiError(errors.ALREADY_FINISHED)
    data = await get_task(pool, client_id, service.name, task_id)
    if finished_now:
        await tell_dispatchers(broker, await _queue_names(pool, service.name), [task_id])
    return data, finished_now


async def _queue_names(pool: Pool, service: str) -> list[str]:
    """Where the service's dispatchers may be: its queue, and the ones it moved away from
    while their dispatchers still run (they finish what they took, and an abort must reach
    them too). A legacy service's too: the seed's workers ignore the exchange, and Conveyor's
    dispatcher serving the queue hears it whatever the format."""
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT queue_name FROM services WHERE name = %(service)s"
            " UNION ALL SELECT queue_name FROM moved_queues WHERE service = %(service)s",
            {"service": service},
        )
        return [row[0] for row in await cursor.fetchall()]


async def tell_ended(pool: Pool, broker: Broker, ended: dict[str, list[uuid.UUID]]) -> None:
    """Tasks the platform ended while they were still queued or running (the watchdog's),
    per service, told to their dispatchers as cancels are: a message a crashed worker left
    is then acked without a call, and a call still under way (its dispatcher frozen past the
    limit) is aborted. Best effort, as a cancel's word is: their results would be ignored."""
    for service, task_ids in ended.items():
        if not await tell_dispatchers(broker, await _queue_names(pool, service), task_ids):
            return  # the broker refused: it is away for the other services too


async def tell_dispatchers(
    broker: Broker, queue_names: list[str], task_ids: list[uuid.UUID]
) -> bool:
    """Broadcasts that the tasks ended on each queue name's `-control` exchange, after
    declaring its `-cancels` stream; False if the broker could not take them all (the tasks
    stay ended; their functions may run, and their results are ignored). A batch of cancels
    (a service deleted) goes out pipelined, and stops at the first refusal: the broker is
    away for the rest too. An exchange deleted since this process declared it (by an
    operator, or with its service's queues) is declared again and the batch sent once more;
    if it still cannot be, the next queue name's are sent all the same."""
    for queue_name in queue_names:
        await _declare_log(broker, queue_name, again=False)
        for start in range(0, len(task_ids), _PIPELINED):
            chunk = task_ids[start : start + _PIPELINED]
            try:
                try:
                    await _broadcast(broker, queue_name, chunk)
                except ExchangeMissing:
                    await _declare_log(broker, queue_name, again=True)
                    await _broadcast(broker, queue_name, chunk)
            except PublishError as exc:
                log.warning(
                    "cancels not broadcast; the tasks stay ended",
                    extra={"queue": queue_name, "tasks": len(task_ids), "error": str(exc)},
                )
                if isinstance(exc, ExchangeMissing):
                    break  # this exchange's: the broker takes the others'
                return False
    return True


async def _declare_log(broker: Broker, queue_name: str, again: bool) -> None:
    """The queue name's `-control` exchange and `-cancels` stream, once per process (or
    `again`, once found deleted); a failure is logged: the broadcast reports its own."""
    key = topology.cancel_log(queue_name)
    if again:
        broker.forget(key)
    try:
        if broker.connected:  # else the publish reports the outage, in its own time
            await broker.declare_once(
                key, partial(topology.declare_cancel_log, queue_name=queue_name)
            )
    except PublishError as exc:
        log.warning(
            "cancel log not declared; a dispatcher started later would not know these cancels",
            extra={"queue": queue_name, "error": str(exc)},
        )


async def _broadcast(broker: Broker, queue_name: str, task_ids: list[uuid.UUID]) -> None:
    """One cancel per task on the queue name's `-control` exchange, pipelined. Every publish
    in flight fails with the channel a missing exchange closes: ExchangeMissing if any says
    so, else the first error."""
    exchange = topology.control_exchange(queue_name)
    outcomes = await asyncio.gather(
        *(broker.publish(encode_cancel(str(t), queue_name), "", exchange) for t in task_ids),
        return_exceptions=True,
    )
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    for error in failed:
        if isinstance(error, ExchangeMissing):
            raise error
    if failed:
        raise failed[0]
