"""PostgreSQL and RabbitMQ for a chaos run: its own servers (started for the run, on
other ports, killed by pid), its database, its platform data and its queues.

The machine's shared servers are never stopped, killed or restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor import topology
from conveyor.connection import connect as connect_broker
from conveyor.events import MessageFormat
from conveyor.settings import GatewaySettings
from gateway.database_url import libpq, with_database
from tests.support.servers import (
    PostgresServer,
    RabbitNode,
    postgres_available,
    rabbitmq_available,
)

log = logging.getLogger("bench.chaos")


# ---------------------------------------------------------------------------
# the run's own database


def create_database(admin_url: str) -> str:
    """CREATE DATABASE chaos_<random>, migrated to head; returns its URL."""
    from gateway.migrate import ensure_database, upgrade

    url = with_database(admin_url, f"chaos_{uuid.uuid4().hex[:10]}")
    ensure_database(url)
    upgrade(url)
    return url


def query(url: str, statement: str, params: dict[str, Any] | None = None) -> list[tuple]:
    with psycopg.connect(libpq(url), autocommit=True, connect_timeout=5) as conn:
        cursor = conn.execute(statement, params or {})
        return cursor.fetchall() if cursor.description else []


# ---------------------------------------------------------------------------
# the platform: one service, one client


@dataclass(frozen=True, slots=True)
class PlatformData:
    service: str
    queue: str
    client_id: str
    secret: str


def apply_platform(database_url: str, amqp_url: str) -> PlatformData:
    """Service (maxAttempts 3, taskTimeout 30, no capacity) and a client, via gateway.admin."""
    suffix = uuid.uuid4().hex[:10]
    data = PlatformData(f"chaos-{suffix}", f"chaos-{suffix}", f"chaos-{suffix}", uuid.uuid4().hex)
    spec = {
        "services": [
            {"name": data.service, "queueName": data.queue, "taskTimeout": 30, "maxAttempts": 3}
        ],
        "clients": [
            {
                "id": data.client_id,
                "secret": data.secret,
                "grants": [{"service": data.service}],
            }
        ],
    }
    asyncio.run(_apply(database_url, spec))
    asyncio.run(_declare(amqp_url, data.queue))
    return data


async def _apply(database_url: str, spec: dict[str, Any]) -> None:
    from gateway import admin
    from gateway.auth import hash_secret
    from gateway.pgpool import connect
    from gateway.platform_file import PlatformSpec

    for client in spec["clients"]:
        # A low bcrypt cost keeps set-up fast; verification is the production path.
        client["secretHash"] = hash_secret(client.pop("secret"), rounds=4)
    async with await connect(database_url) as conn:
        await admin.apply(conn, PlatformSpec.model_validate(spec))


async def _declare(amqp_url: str, queue: str) -> None:
    connection = await connect_broker(amqp_url, name="chaos", timeout=10)
    async with connection:
        channel = await connection.channel()
        limit = GatewaySettings().delivery_limit
        await topology.declare_service(channel, queue, MessageFormat.CLOUDEVENTS, limit)


def delete_queues(amqp_url: str, queue: str) -> None:
    from bench.stack import delete_queues as delete_topology

    try:
        asyncio.run(delete_topology(queue, amqp_url))
    except Exception as exc:  # best effort clean-up; the report is already written
        log.warning("could not delete the run's queues: %r", exc)


@dataclass(frozen=True, slots=True)
class QueueState:
    messages: int  # ready messages
    consumers: int


async def _queue_state(amqp_url: str, name: str) -> QueueState:
    connection = await connect_broker(amqp_url, name="chaos", timeout=5)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        result = queue.declaration_result
        return QueueState(result.message_count or 0, result.consumer_count or 0)


def queue_state(amqp_url: str, name: str) -> QueueState | None:
    """Passive declare; None when the broker cannot be asked right now."""
    try:
        return asyncio.run(asyncio.wait_for(_queue_state(amqp_url, name), 10))
    except Exception as exc:
        log.info("queue %s not inspectable: %r", name, exc)
        return None


# ---------------------------------------------------------------------------
# restarting the servers


class RabbitMQ:
    """The run's own RabbitMQ node: restarted cleanly or killed, never the shared one."""

    def __init__(self) -> None:
        self.node = RabbitNode().start()
        self.url = self.node.url

    def restart(self, down_for: float = 1.0) -> float:
        """stop_app / start_app: connections drop, durable queues survive. Returns seconds."""
        began = time.monotonic()
        self.node.restart(down_for)
        return time.monotonic() - began

    def crash(self, down_for: float = 1.0) -> float:
        """SIGKILL of the node, then a start on the same data. Returns seconds."""
        began = time.monotonic()
        self.node.kill()
        time.sleep(down_for)
        self.node.start()
        return time.monotonic() - began

    def stop(self) -> None:
        self.node.stop()


class PostgreSQL:
    """The run's own PostgreSQL: a fast restart, or a crash of the postmaster and its
    backends (recovered from the WAL at the next start)."""

    def __init__(self) -> None:
        self.server = PostgresServer().start()
        self.admin_url = self.server.admin_url

    def restart(self) -> float:
        began = time.monotonic()
        self.server.shut_down()
        self.server.start()
        return time.monotonic() - began

    def crash(self) -> float:
        began = time.monotonic()
        self.server.kill()
        self.server.start()
        return time.monotonic() - began

    def stop(self) -> None:
        self.server.stop()


def private_servers_missing() -> dict[str, str]:
    """Why the run cannot start its own servers: then it uses the configured ones and the
    server faults are skipped (the shared servers are never restarted)."""
    missing = {}
    if not rabbitmq_available():
        missing["rabbitmq"] = "rabbitmq-server is not installed: no private node to break"
    if not postgres_available():
        missing["postgres"] = "PostgreSQL is not installed: no private cluster to break"
    return missing
