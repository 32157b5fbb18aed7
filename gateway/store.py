"""The task store: creating a task (capacity, idempotency, outbox) and reading one.

A task is accepted only once its row and its outbox entry are committed
together; publishing happens after the commit (see `outbox`). Capacity must
hold under concurrency, so a service with a capacity serializes its own
submissions on a transaction-scoped advisory lock: the count and the insert
then see each other. Services without a capacity take no lock at all.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway import errors
from gateway.catalog import Access
from gateway.models import TaskStatus

IDEMPOTENCY_WINDOW = timedelta(hours=24)


@dataclass(frozen=True, slots=True)
class NewTask:
    client_id: str
    access: Access
    body: dict[str, Any]
    callback: dict[str, Any] | None
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class Accepted:
    task_id: uuid.UUID
    position: int
    created: bool  # False: an idempotent repeat of an earlier submission
    outbox_id: int | None


_INSERT = text(
    """
    WITH ins AS (
        INSERT INTO tasks (task_id, client_id, service, request, callback, idempotency_key)
        VALUES (:task_id, :client_id, :service, :request, :callback, :idempotency_key)
        RETURNING id, task_id
    ), ob AS (
        INSERT INTO outbox (task_id) SELECT task_id FROM ins RETURNING id
    )
    SELECT ins.id, (SELECT id FROM ob) AS outbox_id,
           (SELECT count(*) FROM tasks t
             WHERE t.service = :service AND t.status = 'PENDING' AND t.id < ins.id) + 1 AS position
    FROM ins
    """
).bindparams(
    bindparam("request", type_=JSONB), bindparam("callback", type_=JSONB(none_as_null=True))
)

_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('conveyor.capacity'), hashtext(:service))")
_PENDING_SERVICE = text(
    "SELECT count(*) FROM tasks WHERE service = :service AND status = 'PENDING'"
)
_PENDING_CLIENT = text(
    "SELECT count(*) FROM tasks"
    " WHERE service = :service AND client_id = :client_id AND status = 'PENDING'"
)
_BY_KEY = text(
    """
    SELECT id, task_id, status, submission_date FROM tasks
    WHERE client_id = :client_id AND service = :service AND idempotency_key = :key
    """
)
_FORGET_KEY = text("UPDATE tasks SET idempotency_key = NULL WHERE id = :id")
_POSITION = text(
    "SELECT count(*) FROM tasks WHERE service = :service AND status = 'PENDING' AND id <= :id"
)


async def create_task(engine: AsyncEngine, new: NewTask) -> Accepted:
    try:
        async with engine.begin() as conn:
            return await _create(conn, new)
    except IntegrityError:
        # Two concurrent requests with one Idempotency-Key: the loser answers the winner's task.
        if new.idempotency_key is None:
            raise
        async with engine.begin() as conn:
            repeat = await _idempotent_repeat(conn, new)
        if repeat is None:
            raise
        return repeat


async def _create(conn: AsyncConnection, new: NewTask) -> Accepted:
    if new.idempotency_key is not None:
        repeat = await _idempotent_repeat(conn, new)
        if repeat is not None:
            return repeat
    service = new.access.service
    if service.capacity is not None or new.access.client_capacity is not None:
        await _check_capacity(conn, new)
    task_id = uuid.uuid4()
    row = (
        await conn.execute(
            _INSERT,
            {
                "task_id": task_id,
                "client_id": new.client_id,
                "service": service.name,
                "request": new.body,
                "callback": new.callback,
                "idempotency_key": new.idempotency_key,
            },
        )
    ).one()
    return Accepted(task_id, row.position, True, row.outbox_id)


async def _check_capacity(conn: AsyncConnection, new: NewTask) -> None:
    service = new.access.service
    params = {"service": service.name, "client_id": new.client_id}
    await conn.execute(_LOCK, params)
    if service.capacity is not None:
        if (await conn.execute(_PENDING_SERVICE, params)).scalar_one() >= service.capacity:
            raise errors.ApiError(errors.SERVICE_CAPACITY)
    if new.access.client_capacity is not None:
        pending = (await conn.execute(_PENDING_CLIENT, params)).scalar_one()
        if pending >= new.access.client_capacity:
            raise errors.ApiError(errors.CLIENT_CAPACITY)


async def _idempotent_repeat(conn: AsyncConnection, new: NewTask) -> Accepted | None:
    params = {
        "client_id": new.client_id,
        "service": new.access.service.name,
        "key": new.idempotency_key,
    }
    row = (await conn.execute(_BY_KEY, params)).first()
    if row is None:
        return None
    if row.submission_date < datetime.now(UTC) - IDEMPOTENCY_WINDOW:
        await conn.execute(_FORGET_KEY, {"id": row.id})
        return None
    position = 0
    if row.status == TaskStatus.PENDING:
        position = await _position(conn, new.access.service.name, row.id)
    return Accepted(row.task_id, position, False, None)


async def _position(conn: AsyncConnection, service: str, row_id: int) -> int:
    return (await conn.execute(_POSITION, {"service": service, "id": row_id})).scalar_one()


# ---------------------------------------------------------------------------
# reading a task

_GET = text(
    """
    SELECT id, task_id, client_id, service, status, submission_date, start_date, end_date,
           progress, response, error_message, worker_host
    FROM tasks WHERE task_id = :task_id
    """
)


def iso(value: datetime | None) -> str | None:
    """ISO-8601 UTC with milliseconds and `Z`, as the seed's examples."""
    if value is None:
        return None
    return (
        value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    )


def task_view(row: Any, position: int | None = None) -> dict[str, Any]:
    """The poll's `data` (also the callback body): fields present by status, SPEC §3.2."""
    status = TaskStatus(row.status)
    data: dict[str, Any] = {
        "taskId": str(row.task_id),
        "status": status.value,
        "submitionDate": iso(row.submission_date),
    }
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


async def get_task(
    engine: AsyncEngine, client_id: str, service: str, task_id: uuid.UUID
) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (await conn.execute(_GET, {"task_id": task_id})).first()
        # Another client's task, or another service's, does not exist for this caller.
        if row is None or row.client_id != client_id or row.service != service:
            raise errors.ApiError(errors.TASK_NOT_FOUND)
        position = None
        if row.status == TaskStatus.PENDING:
            position = await _position(conn, service, row.id)
        return task_view(row, position)
