"""Cancelling a task (SPEC §11.1): FAILURE at once in the database, then word to the
dispatchers.

The database decides: the task becomes FAILURE `Task cancelled.` through the state machine's
guarded statement (`lifecycle.failure`), so a result that arrives later changes nothing
(terminal wins), whether a dispatcher heard the cancel or not. The broadcast on the service's
`<queue>-control` exchange only spares the function's work: a dispatcher running the task
aborts the call (the function sees its connection closed) and acks the message; one that
receives it later acks it without a call, and so does one started later (scaled from zero, a
Job), which reads the service's `<queue>-cancels` stream, bound to the exchange with the
service's first cancel, before it takes any submission. If the broadcast cannot be sent (the
broker is down), the cancel still stands; the function may then run to its end, and its
result is ignored.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from conveyor import topology
from conveyor.events import MessageFormat, encode_cancel
from gateway import errors, lifecycle, metrics
from gateway.broker import Broker, PublishError
from gateway.catalog import Service
from gateway.pgpool import Pool
from gateway.store import get_task

log = logging.getLogger("conveyor.gateway.cancel")

CANCELLED = "Task cancelled."
UNFINISHED = ("PENDING", "IN_PROGRESS")


async def cancel_task(
    pool: Pool, broker: Broker, client_id: str, service: Service, task_id: uuid.UUID
) -> tuple[dict[str, Any], bool]:
    """The task's poll data once cancelled, and whether this call finished it (the notifier
    then has a callback to send if it has one). 409001 if it had finished otherwise."""
    data = await get_task(pool, client_id, service.name, task_id)  # 404002 for strangers
    finished_now = False
    if data["status"] in UNFINISHED:
        change = lifecycle.failure(task_id, CANCELLED)
        async with pool.connection() as conn:
            outcome = await lifecycle.apply(conn, change)
        finished_now = outcome.applied is lifecycle.Applied.FINISHED
        if (done := outcome.finished) is not None:
            metrics.task_finished(done.service, done.status, done.waited, done.ran)
        data = await get_task(pool, client_id, service.name, task_id)
    if data["status"] != "FAILURE" or data.get("errorMessage") != CANCELLED:
        raise errors.ApiError(errors.ALREADY_FINISHED)
    if finished_now and service.message_format is MessageFormat.CLOUDEVENTS:
        await _tell_dispatchers(broker, service.queue_name, str(task_id))
    return data, finished_now


async def _tell_dispatchers(broker: Broker, queue_name: str, task_id: str) -> None:
    try:
        if broker.connected:  # else the publish below reports the outage, in its own time
            await broker.declare_once(
                topology.cancel_log(queue_name),
                lambda channel: topology.declare_cancel_log(channel, queue_name),
            )
    except PublishError as exc:
        log.warning(
            "cancel log not declared; a dispatcher started later would not know this cancel",
            extra={"task_id": task_id, "error": str(exc)},
        )
    try:
        await broker.publish(
            encode_cancel(task_id, queue_name), "", topology.control_exchange(queue_name)
        )
    except PublishError as exc:
        log.warning(
            "cancel not broadcast; the task stays cancelled",
            extra={"task_id": task_id, "error": str(exc)},
        )
