"""PostgreSQL and RabbitMQ for a chaos run: its own database, its platform data, its
queues, and restarts of the real servers (always left running afterwards).

Restarts are only possible when the servers are the local ones managed by
`rabbitmqctl` and `pg_ctlcluster`; `restart_blockers` says why not otherwise,
and the run then skips those two fault kinds.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import bcrypt
import psycopg
from psycopg import sql

from conveyor import topology
from conveyor.events import MessageFormat
from conveyor.settings import GatewaySettings, normalize_database_url

log = logging.getLogger("bench.chaos")

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


# ---------------------------------------------------------------------------
# the run's own database


def psycopg_url(url: str) -> str:
    return normalize_database_url(url).replace("postgresql+psycopg://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    base, _, _ = normalize_database_url(url).rpartition("/")
    return f"{base}/{name}"


def create_database(admin_url: str) -> str:
    """CREATE DATABASE chaos_<random>, migrated to head; returns its URL."""
    from gateway.migrate import upgrade

    name = f"chaos_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(psycopg_url(with_database(admin_url, "postgres")), autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_database(admin_url, name)
    upgrade(url)
    return url


def drop_database(admin_url: str, url: str) -> None:
    name = url.rpartition("/")[2]
    with psycopg.connect(psycopg_url(with_database(admin_url, "postgres")), autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def query(url: str, statement: str, params: dict[str, Any] | None = None) -> list[tuple]:
    with psycopg.connect(psycopg_url(url), autocommit=True, connect_timeout=5) as conn:
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
                # A low bcrypt cost keeps set-up fast; verification is the production path.
                "secretHash": bcrypt.hashpw(data.secret.encode(), bcrypt.gensalt(4)).decode(),
                "grants": [{"service": data.service}],
            }
        ],
    }
    asyncio.run(_apply(database_url, spec))
    asyncio.run(_declare(amqp_url, data.queue))
    return data


async def _apply(database_url: str, spec: dict[str, Any]) -> None:
    from gateway import admin
    from gateway.db import create_engine
    from gateway.platform_file import PlatformSpec

    engine = create_engine(GatewaySettings(database_url=database_url))
    try:
        await admin.apply(engine, PlatformSpec.model_validate(spec))
    finally:
        await engine.dispose()


async def _declare(amqp_url: str, queue: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        limit = GatewaySettings().delivery_limit
        await topology.declare_service(channel, queue, MessageFormat.CLOUDEVENTS, limit)


async def _delete_queues(amqp_url: str, queue: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for spec in topology.service_queues(queue, MessageFormat.CLOUDEVENTS, 0):
            await channel.queue_delete(spec.name)


def delete_queues(amqp_url: str, queue: str) -> None:
    try:
        asyncio.run(_delete_queues(amqp_url, queue))
    except Exception as exc:  # best effort clean-up; the report is already written
        log.warning("could not delete the run's queues: %r", exc)


@dataclass(frozen=True, slots=True)
class QueueState:
    messages: int  # ready messages
    consumers: int


async def _queue_state(amqp_url: str, name: str) -> QueueState:
    connection = await aio_pika.connect(amqp_url, timeout=5)
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


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def restart_blockers(admin_db_url: str, amqp_url: str) -> dict[str, str]:
    """Why each server cannot be restarted here ({} when both can)."""
    blockers: dict[str, str] = {}
    if shutil.which("rabbitmqctl") is None:
        blockers["rabbitmq"] = "rabbitmqctl is not installed"
    elif _host_port(amqp_url, 5672)[0] not in LOCAL_HOSTS:
        blockers["rabbitmq"] = "the AMQP URL points at a broker elsewhere"
    if shutil.which("pg_ctlcluster") is None or shutil.which("pg_lsclusters") is None:
        blockers["postgres"] = "pg_ctlcluster is not installed"
    elif _host_port(psycopg_url(admin_db_url), 5432)[0] not in LOCAL_HOSTS:
        blockers["postgres"] = "the database URL points at a server elsewhere"
    elif pg_cluster(admin_db_url) is None:
        blockers["postgres"] = "no local PostgreSQL cluster listens on the URL's port"
    return blockers


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


class RabbitMQ:
    def __init__(self, amqp_url: str) -> None:
        self.host, self.port = _host_port(amqp_url, 5672)

    def restart(self, down_for: float = 1.0) -> float:
        """stop_app / start_app: connections drop, durable queues survive. Returns seconds."""
        began = time.monotonic()
        try:
            _run(["rabbitmqctl", "stop_app"], 60)
            time.sleep(down_for)
        finally:
            self.ensure_running()
        return time.monotonic() - began

    def ensure_running(self, timeout: float = 90.0) -> bool:
        if port_open(self.host, self.port):
            return True
        _run(["rabbitmqctl", "start_app"], timeout)
        _run(["rabbitmqctl", "await_startup"], timeout)
        return _wait_port(self.host, self.port, 60)


def pg_cluster(admin_db_url: str) -> tuple[str, str] | None:
    """(version, name) of the local cluster on the URL's port, from pg_lsclusters."""
    _, port = _host_port(psycopg_url(admin_db_url), 5432)
    try:
        listing = _run(["pg_lsclusters", "--no-header"], 10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == str(port):
            return fields[0], fields[1]
    return None


class PostgreSQL:
    def __init__(self, admin_db_url: str) -> None:
        self.host, self.port = _host_port(psycopg_url(admin_db_url), 5432)
        self.cluster = pg_cluster(admin_db_url) or ("15", "main")

    def _ctl(self, action: str, timeout: float = 60) -> None:
        version, name = self.cluster
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, action], timeout)

    def restart(self) -> float:
        """A fast shutdown and start: every connection drops. Returns seconds."""
        began = time.monotonic()
        try:
            self._ctl("restart")
        finally:
            self.ensure_running()
        return time.monotonic() - began

    def ensure_running(self) -> bool:
        if port_open(self.host, self.port):
            return True
        self._ctl("start")
        return _wait_port(self.host, self.port, 60)


def _wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return True
        time.sleep(0.2)
    return False
