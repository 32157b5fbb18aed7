"""The task state machine (SPEC §6.4), the only place task state changes.

    PENDING ──started──▶ IN_PROGRESS ──succeeded──▶ SUCCESS
       │                  │    ▲  │
       │                  │    └──┘ started of a *new* attempt: new worker_host,
       │                  │         progress 0, start_date reset (redelivery)
       └──────────────────┴──failed / dead-lettered / expired──▶ FAILURE

Each transition is one guarded UPDATE: the WHERE clause is the state machine's
precondition, re-checked by PostgreSQL under the row lock. That is what makes
duplicated, late and reordered events harmless, even with several gateway
replicas applying events concurrently:

* terminal states are final: every statement requires a non-terminal status;
* a `started` resets the task only for an attempt it has not seen yet and that
  began after the current one (the `conveyorattempt` extension and event time);
* `progress` applies to the current attempt only, and only upwards;
* the first terminal event wins.

Every attempt is also recorded in `task_attempts` for investigation in SQL.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from conveyor.events import EventKind, TaskEvent, now


class Applied(enum.Enum):
    CHANGED = "changed"
    IGNORED = "ignored"  # a duplicate, a late event, or an unknown task
    FINISHED = "finished"  # reached a terminal state (the notifier may have work)


_STARTED = text(
    """
    WITH task AS (
        UPDATE tasks
           SET status = 'IN_PROGRESS', worker_host = CAST(:host AS text), start_date = :time,
               progress = 0, attempt_id = :attempt, attempts = attempts + 1, updated_at = now()
         WHERE task_id = :task_id
           AND (status = 'PENDING'
                OR (status = 'IN_PROGRESS' AND attempt_id IS DISTINCT FROM :attempt
                    AND start_date < :time))
        RETURNING task_id
    ), closed AS (
        UPDATE task_attempts a SET end_date = :time, outcome = 'interrupted'
          FROM task
         WHERE a.task_id = task.task_id AND a.end_date IS NULL AND a.attempt_id <> :attempt
    ), opened AS (
        INSERT INTO task_attempts (task_id, attempt_id, worker_host, start_date)
        SELECT task_id, CAST(:attempt AS text), CAST(:host AS text), :time FROM task
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    )
    SELECT count(*) FROM task
    """
)

_PROGRESS = text(
    """
    UPDATE tasks SET progress = :progress, updated_at = now()
     WHERE task_id = :task_id AND status = 'IN_PROGRESS' AND progress < :progress
       AND (CAST(:attempt AS text) IS NULL OR attempt_id = :attempt)
    """
)

_FINISH = text(
    """
    WITH task AS (
        UPDATE tasks
           SET status = CAST(:status AS text), end_date = :time, updated_at = now(),
               start_date = COALESCE(start_date, :time),
               response = CASE WHEN CAST(:status AS text) = 'SUCCESS' THEN :response END,
               error_message = CAST(:error_message AS text),
               progress = CASE WHEN CAST(:status AS text) = 'SUCCESS' THEN 100 ELSE progress END,
               notification_status = CASE WHEN callback IS NOT NULL THEN 'PENDING' END
         WHERE task_id = :task_id AND status IN ('PENDING', 'IN_PROGRESS')
        RETURNING task_id, attempt_id
    ), history AS (
        UPDATE task_attempts a
           SET end_date = :time, outcome = lower(CAST(:status AS text)),
               error_message = CAST(:error_message AS text)
          FROM task
         WHERE a.task_id = task.task_id AND a.end_date IS NULL
           AND a.attempt_id = COALESCE(CAST(:attempt AS text), task.attempt_id)
    )
    SELECT count(*) FROM task
    """
).bindparams(bindparam("response", type_=JSONB))


def _time(event_time: datetime | None) -> datetime:
    return event_time or now()


async def apply(conn: AsyncConnection, event: TaskEvent) -> Applied:
    """Applies one event inside the caller's transaction."""
    task_id = uuid.UUID(event.task_id)
    time = _time(event.time)
    match event.kind:
        case EventKind.STARTED:
            params = {
                "task_id": task_id,
                "host": event.host,
                "time": time,
                # Legacy workers send no attempt id: each of their `started` is a new attempt.
                "attempt": event.attempt or event.event_id,
            }
            changed = (await conn.execute(_STARTED, params)).scalar_one()
            return Applied.CHANGED if changed else Applied.IGNORED
        case EventKind.PROGRESS:
            params = {"task_id": task_id, "progress": event.progress, "attempt": event.attempt}
            result = await conn.execute(_PROGRESS, params)
            return Applied.CHANGED if result.rowcount else Applied.IGNORED
        case EventKind.SUCCEEDED:
            return await _finish(
                conn, task_id, "SUCCESS", time, event.attempt, event.response, None
            )
        case EventKind.FAILED:
            message = event.error_message or "The function failed without a message."
            return await _finish(conn, task_id, "FAILURE", time, event.attempt, None, message)


async def fail(conn: AsyncConnection, task_id: uuid.UUID, message: str) -> Applied:
    """FAILURE decided by the platform itself: dead-lettered or expired."""
    return await _finish(conn, task_id, "FAILURE", now(), None, None, message)


async def _finish(
    conn: AsyncConnection,
    task_id: uuid.UUID,
    status: str,
    time: datetime,
    attempt: str | None,
    response: Any,
    error_message: str | None,
) -> Applied:
    params = {
        "task_id": task_id,
        "status": status,
        "time": time,
        "attempt": attempt,
        "response": response,
        "error_message": error_message,
    }
    changed = (await conn.execute(_FINISH, params)).scalar_one()
    return Applied.FINISHED if changed else Applied.IGNORED


_EXPIRE = text(
    """
    UPDATE tasks t
       SET status = 'FAILURE', end_date = now(), updated_at = now(),
           error_message = 'The task expired: it stayed PENDING longer than its time to live.',
           notification_status = CASE WHEN t.callback IS NOT NULL THEN 'PENDING' END
      FROM services s
     WHERE s.name = t.service AND t.status = 'PENDING'
       AND t.submission_date < now() - make_interval(secs => LEAST(:ttl, s.retention_seconds))
    """
)


async def expire_pending(conn: AsyncConnection, ttl: float) -> int:
    """The reaper's transition: PENDING past its time to live becomes FAILURE."""
    return (await conn.execute(_EXPIRE, {"ttl": ttl})).rowcount
