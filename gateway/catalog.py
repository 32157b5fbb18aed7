"""Services and grants as the API needs them, with compiled JSON Schemas.

Service definitions change rarely (`conveyor admin apply`) but are read on
every request, so a request costs at most one indexed lookup (`gateway.access_cache` keeps
its answer); `gateway.body_schema` compiles their schemas. The queries run on raw psycopg
connections (`gateway.pgpool`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from conveyor.events import MessageFormat


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    queue_name: str
    capacity: int | None
    json_schema: dict[str, Any] | None
    message_format: MessageFormat
    task_timeout: int
    max_attempts: int
    retention_seconds: int
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Access:
    service: Service
    granted: bool
    client_capacity: int | None


_ACCESS = """
    SELECT s.name, s.queue_name, s.capacity, s.json_schema, s.message_format, s.task_timeout,
           s.max_attempts, s.retention_seconds, s.updated_at,
           a.client_id IS NOT NULL AS granted, a.capacity AS client_capacity
    FROM services s
    LEFT JOIN authorizations a ON a.service = s.name AND a.client_id = %(client_id)s
    WHERE s.name = %(service)s
    """

_ALL = """
    SELECT name, queue_name, capacity, json_schema, message_format, task_timeout,
           max_attempts, retention_seconds, updated_at
    FROM services ORDER BY name
    """


def _service(row: Any) -> Service:
    return Service(
        name=row.name,
        queue_name=row.queue_name,
        capacity=row.capacity,
        json_schema=row.json_schema,
        message_format=MessageFormat(row.message_format),
        task_timeout=row.task_timeout,
        max_attempts=row.max_attempts,
        retention_seconds=row.retention_seconds,
        updated_at=row.updated_at,
    )


async def access(conn: psycopg.AsyncConnection[Any], client_id: str, service: str) -> Access | None:
    cursor = await conn.execute(_ACCESS, {"client_id": client_id, "service": service})
    row = await cursor.fetchone()
    if row is None:
        return None
    return Access(_service(row), row.granted, row.client_capacity)


async def all_services(conn: psycopg.AsyncConnection[Any]) -> list[Service]:
    return [_service(row) for row in await (await conn.execute(_ALL)).fetchall()]


async def moved_queues(conn: psycopg.AsyncConnection[Any]) -> set[str]:
    """The queue names services moved away from, whose queues may still hold results."""
    cursor = await conn.execute("SELECT queue_name FROM moved_queues")
    return {row[0] for row in await cursor.fetchall()}


async def forget_moved(conn: psycopg.AsyncConnection[Any], queue_name: str) -> None:
    """The queues a service left are gone: nothing will report there again."""
    await conn.execute("DELETE FROM moved_queues WHERE queue_name = %(q)s", {"q": queue_name})
